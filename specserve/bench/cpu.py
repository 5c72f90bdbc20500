"""`specserve bench cpu`: the CPU's ways to serve one GGUF model, in one run, one thread count.

On the same chat-templated prompts (MT-bench's first turns, or with `--prompts repetitive`
the repeat-and-edit-this-code set where n-gram drafts match), greedy, batch 1, one prompt
after another:
specserve with float weights (`--quantization none`), specserve in the GGUF's blocks
(plain, NGRAM, EAGLE-3 where the model has a shipped head), Hugging Face transformers on
the float weights, and llama.cpp's `llama-bench` on the GGUF itself when one is on PATH
(`--llama-bench`; otherwise a line says it was skipped). Each row: tokens/s, its ratio to
the blocks' plain row, and how many outputs equal the blocks' plain ones (llama.cpp's are
not compared: llama-bench generates no text from our prompts, it times its own decode of
`--max-new-tokens` tokens). Appends one JSON line per row to --output.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from specserve.bench.prompts import mt_bench_first_turns
from specserve.bench.repetitive import repetitive_prompts
from specserve.bench.report import report
from specserve.bench.spec_compare import warm_up

CONFIGS: dict[str, dict[str, Any]] = {  # row name -> Engine flags
    "float": {"quantization": "none"},
    "gguf": {},
    "gguf+NGRAM": {"speculative_algorithm": "NGRAM"},
    "gguf+NGRAM-always": {"speculative_algorithm": "NGRAM", "speculative_adaptive": "off"},  # no governor
    "gguf+EAGLE3": {"speculative_algorithm": "EAGLE3"},
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench cpu")
    p.add_argument("--model", default="smollm2-135m", help="a catalogue name or a .gguf file")
    p.add_argument("--threads", type=int, default=None, help="threads for every engine (default: torch's)")
    p.add_argument("--prompts", choices=("mtbench", "repetitive"), default="mtbench",
                   help="MT-bench's first turns, or the repeat-and-edit-this-code set where n-grams match")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--configs", default="float,gguf,gguf+NGRAM,gguf+EAGLE3", help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True, help="time transformers too")
    p.add_argument("--llama-bench", default="llama-bench", help="llama.cpp's llama-bench binary")
    p.add_argument("--output", default="bench_cpu.jsonl")
    return p


def _time_engine(flags: dict[str, Any], model: str, prompts: list[list[int]], max_new: int):
    from specserve import Engine

    with Engine(model, device="cpu", log_level="warning", **flags) as engine:
        params = {"temperature": 0, "max_new_tokens": max_new}
        warm_up(engine, prompts, 1)
        outs, start = [], time.perf_counter()
        for ids in prompts:
            outs.append(engine.generate(input_ids=ids, sampling_params=params)["output_ids"])
            engine.flush_cache()
        return time.perf_counter() - start, outs, engine.server_info()["weight_quantization"]["method"] or "float32"


def _time_hf(model_dir: Path, prompts: list[list[int]], max_new: int, eos: list[int]):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    gen = dict(do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=eos[0])
    with torch.no_grad():
        hf.generate(torch.tensor([prompts[0]]), **{**gen, "max_new_tokens": 8})
        outs, start = [], time.perf_counter()
        for ids in prompts:
            outs.append(hf.generate(torch.tensor([ids]), **gen)[0, len(ids):].tolist())
    return time.perf_counter() - start, outs


def _llama_bench(exe: str, gguf: Path, threads: int, tokens: int) -> float:
    """llama.cpp's decode tokens/s of `tokens` tokens (its `tg` test)."""
    out = subprocess.run([exe, "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(tokens), "-o", "csv"],
                         capture_output=True, text=True, check=True, timeout=1800).stdout
    header, *rows = [line.split(",") for line in out.strip().splitlines()]
    col = [h.strip('"') for h in header].index("avg_ts")
    return float(rows[-1][col].strip('"'))


def _gguf_file(model: str, into: Path) -> Path:
    if model.endswith(".gguf"):
        return Path(model)
    from specserve.models.catalogue import download_gguf

    return download_gguf(model, into)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    from specserve.models.source import resolve_model_dir
    from specserve.tokenizer.tokenizer import load_tokenizer

    model_dir = resolve_model_dir(args.model)
    tok = load_tokenizer(model_dir)
    texts = (mt_bench_first_turns if args.prompts == "mtbench" else repetitive_prompts)(args.num_prompts)
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in texts]
    base = {"bench": "cpu", "model": args.model, "prompts": args.prompts, "threads": threads,
            "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens}
    rows: list[dict[str, Any]] = []
    ref: list[list[int]] | None = None
    for name in args.configs.split(","):
        seconds, outs, method = _time_engine(CONFIGS[name], args.model, prompts, args.max_new_tokens)
        ref = outs if name == "gguf" else ref
        rows.append({"engine": f"specserve {name}", "weights": method, "tok_s": sum(map(len, outs)) / seconds,
                     "outs": outs})
    if args.hf:
        seconds, outs = _time_hf(model_dir, prompts, args.max_new_tokens, sorted(tok.eos_token_ids))
        rows.append({"engine": "transformers", "weights": "float32", "tok_s": sum(map(len, outs)) / seconds,
                     "outs": outs})
    exe, tg = shutil.which(args.llama_bench), None
    if exe is not None:
        with tempfile.TemporaryDirectory() as tmp:
            tg = _llama_bench(exe, _gguf_file(args.model, Path(tmp)), threads, args.max_new_tokens)
    if tg is None:
        print(f"llama.cpp: skipped ({args.llama_bench!r} is not on PATH; --llama-bench names it)")
    else:
        rows.append({"engine": "llama.cpp llama-bench", "weights": "gguf", "tok_s": tg, "outs": None})
    plain = next((r["tok_s"] for r in rows if r["engine"] == "specserve gguf"), None)
    for r in rows:
        outs = r.pop("outs")
        same = None if ref is None or outs is None else sum(a == b for a, b in zip(outs, ref))
        row = {**base, **r, "vs_gguf_plain": r["tok_s"] / plain if plain else None, "same_as_gguf_plain": same}
        ratio = f"{row['vs_gguf_plain']:.2f}x" if plain else "-"
        report(f"cpu: {r['engine']:<24} {r['weights']:<8} {r['tok_s']:7.1f} tok/s  {ratio:>6} of gguf plain  "
               f"same outputs {same if same is not None else '-'}/{len(prompts)}  ({threads} threads)",
               row, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
