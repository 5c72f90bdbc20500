"""`specserve bench cpu`: the CPU's ways to serve one GGUF model, in one run, one thread count.

On the same chat-templated prompts (MT-bench's first turns, or with `--prompts repetitive`
the repeat-and-edit-this-code set where n-gram drafts match), greedy, batch 1, one prompt
after another, the engines taking turns prompt by prompt:
specserve with float weights (`--quantization none`), specserve in the GGUF's blocks
(plain, NGRAM, EAGLE-3 where the model has a shipped head), Hugging Face transformers on
the float weights, and llama.cpp's `llama-bench` on the GGUF itself when one is on PATH
(`--llama-bench`; otherwise a line says it was skipped). Each row: tokens/s end to end
(prefill included) and decoding alone (from each prompt's first token to its last), their
ratios to the blocks' plain row and to llama.cpp's decoding, and how many outputs equal
the blocks' plain ones. llama-bench generates no text from our prompts: it takes its turn
after our engines' on each prompt, timing a prompt of that prompt's length (`pp`) and a
decode of `--max-new-tokens` tokens (`tg`), so its decoding row is `tg`, the like of ours,
and its end-to-end row is what those rates give for our prompts and plain's output lengths.
Appends one JSON line per row to --output.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
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
    p.add_argument("--prompts", choices=("mtbench", "mtbench-spread", "repetitive"), default="mtbench",
                   help="MT-bench's first turns (its first questions, writing ones; or taken evenly over its "
                        "80 questions, every category), or the repeat-and-edit-this-code set where n-grams match")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--configs", default="float,gguf,gguf+NGRAM,gguf+EAGLE3", help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True, help="time transformers too")
    p.add_argument("--llama-bench", default="llama-bench", help="llama.cpp's llama-bench binary")
    p.add_argument("--output", default="bench_cpu.jsonl")
    return p


@dataclass
class _Timed:
    seconds: float = 0.0  # in all
    decode: float = 0.0  # after each prompt's first token
    outs: list[list[int]] = field(default_factory=list)
    method: str = "float32"  # the weights' format


def _time_engines(names: list[str], model: str, prompts: list[list[int]], max_new: int,
                  between: Callable[[list[int]], None] | None = None) -> dict[str, _Timed]:
    """Every config's engine, alive together and taking turns prompt by prompt: a shared
    machine's speed drifts within minutes, and timed one config after another the drift
    falls on whichever row runs later. `between(prompt)` takes its turn after theirs
    (llama.cpp's, `_LlamaTurns`)."""
    from specserve import Engine

    with ExitStack() as stack:
        engines = {n: stack.enter_context(Engine(model, device="cpu", log_level="warning", **CONFIGS[n]))
                   for n in names}
        timed = {n: _Timed(method=e.server_info()["weight_quantization"]["method"] or "float32")
                 for n, e in engines.items()}
        for engine in engines.values():
            warm_up(engine, prompts, 1)
        for i, ids in enumerate(prompts):
            for n, engine in engines.items():
                start = time.perf_counter()
                out, decode = _generate(engine, f"bench-cpu-{i}", ids, max_new)
                engine.flush_cache()
                t = timed[n]
                t.seconds += time.perf_counter() - start
                t.decode += decode
                t.outs.append(out)
            if between is not None:
                between(ids)
        return timed


def _generate(engine, rid: str, ids: list[int], max_new: int) -> tuple[list[int], float]:
    """One greedy request through the engine's scheduler: (its output ids, the seconds from
    its first token, which its prefill gives, to its last: its decode alone, as llama-bench's
    `tg` times one)."""
    from specserve.core.messages import GenerateReq
    from specserve.offline import make_sampling_params

    sched = engine.scheduler
    outs = sched.add_request(GenerateReq(rid, ids, make_sampling_params({"temperature": 0, "max_new_tokens": max_new})))
    got: list[int] = []
    first = None
    while True:
        for out in outs:
            got += out.token_ids
            if out.finished:
                return got, time.perf_counter() - (first or time.perf_counter())
        if got and first is None:
            first = time.perf_counter()
        outs = sched.step()


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


@dataclass
class _LlamaTurns:
    """llama-bench's turn after each prompt's engines: one run (after its own warm-up) of
    its `pp` test at that prompt's length and its `tg` test of `tokens` tokens; the rates
    are the runs' tokens over their seconds."""

    exe: str
    gguf: Path
    threads: int
    tokens: int
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    gen_tokens: int = 0
    gen_seconds: float = 0.0

    def __call__(self, ids: list[int]) -> None:
        pp, tg = _llama_bench(self.exe, self.gguf, self.threads, len(ids), self.tokens, reps=1)
        self.prompt_tokens += len(ids)
        self.prompt_seconds += len(ids) / pp
        self.gen_tokens += self.tokens
        self.gen_seconds += self.tokens / tg

    def rates(self) -> tuple[float, float]:
        """(pp, tg) tokens/s over every turn."""
        return self.prompt_tokens / self.prompt_seconds, self.gen_tokens / self.gen_seconds


def _llama_bench(exe: str, gguf: Path, threads: int, prompt: int, tokens: int, reps: int = 5) -> tuple[float, float]:
    """llama.cpp's tokens/s over a prompt of `prompt` tokens (its `pp` test) and decoding
    `tokens` tokens (its `tg` test), each the mean of `reps` runs."""
    argv = [exe, "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(tokens), "-r", str(reps),
            "-o", "csv"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=1800).stdout
    header, *rows = [line.split(",") for line in out.strip().splitlines()]
    names = [h.strip('"') for h in header]
    rate = {int(r[names.index("n_prompt")].strip('"')) > 0: float(r[names.index("avg_ts")].strip('"')) for r in rows}
    return rate[True], rate[False]


def _gguf_file(model: str, into: Path) -> Path:
    if model.endswith(".gguf"):
        return Path(model)
    from specserve.models.catalogue import download_gguf

    return download_gguf(model, into)


def _texts(kind: str, n: int) -> list[str]:
    """The prompts of `--prompts kind`: n of them."""
    if kind == "repetitive":
        return repetitive_prompts(n)
    if kind == "mtbench":
        return mt_bench_first_turns(n)
    every = mt_bench_first_turns()  # mtbench-spread: evenly over the questions, so every category
    return [every[i * len(every) // n] for i in range(min(n, len(every)))]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    from specserve.models.source import resolve_model_dir
    from specserve.tokenizer.tokenizer import load_tokenizer

    model_dir = resolve_model_dir(args.model)
    tok = load_tokenizer(model_dir)
    texts = _texts(args.prompts, args.num_prompts)
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in texts]
    base = {"bench": "cpu", "model": args.model, "prompts": args.prompts, "threads": threads,
            "num_prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "max_new_tokens": args.max_new_tokens}
    rows: list[dict[str, Any]] = []
    exe = shutil.which(args.llama_bench)
    with tempfile.TemporaryDirectory() as tmp:
        llama = None if exe is None else _LlamaTurns(exe, _gguf_file(args.model, Path(tmp)), threads,
                                                     args.max_new_tokens)
        timed = _time_engines(args.configs.split(","), args.model, prompts, args.max_new_tokens, llama)
    ref = timed["gguf"].outs if "gguf" in timed else None
    for name, t in timed.items():
        made = sum(map(len, t.outs))
        rows.append({"engine": f"specserve {name}", "weights": t.method, "tokens": made, "tok_s": made / t.seconds,
                     "decode_tok_s": (made - len(t.outs)) / t.decode, "outs": t.outs})
    if args.hf:
        seconds, outs = _time_hf(model_dir, prompts, args.max_new_tokens, sorted(tok.eos_token_ids))
        rows.append({"engine": "transformers", "weights": "float32", "tok_s": sum(map(len, outs)) / seconds,
                     "decode_tok_s": None, "outs": outs})
    if llama is None:
        print(f"llama.cpp: skipped ({args.llama_bench!r} is not on PATH; --llama-bench names it)")
    else:
        pp, tg = llama.rates()
        # end to end as ours is timed: each prompt's prefill at pp's rate, then as many tokens as plain gave at tg's
        tokens = sum(map(len, ref)) if ref is not None else args.max_new_tokens * len(prompts)
        rows.append({"engine": "llama.cpp llama-bench", "weights": "gguf", "decode_tok_s": tg, "outs": None,
                     "tok_s": tokens / (llama.prompt_tokens / pp + tokens / tg), "prefill_tok_s": pp})
    _report(rows, ref, base, args.output)
    return 0


def _report(rows: list[dict[str, Any]], ref: list[list[int]] | None, base: dict[str, Any], output: str) -> None:
    """One line and one JSON line a row: its tokens/s end to end and decoding, their ratios
    to the blocks' plain row and llama.cpp's, and how many outputs equal plain's."""
    plain = next((r for r in rows if r["engine"] == "specserve gguf"), None)
    llama = next((r for r in rows if r["engine"].startswith("llama.cpp")), None)
    for r in rows:
        outs = r.pop("outs")
        same = None if ref is None or outs is None else sum(a == b for a, b in zip(outs, ref))
        decode = r["decode_tok_s"]
        row = {**base, **r, "same_as_gguf_plain": same,
               "vs_gguf_plain": r["tok_s"] / plain["tok_s"] if plain else None,
               "decode_vs_llama_cpp": decode / llama["decode_tok_s"] if llama and decode else None}
        ratios = "".join(f"  {row[k]:.2f}x {what}" for k, what in (("vs_gguf_plain", "gguf plain"),
                         ("decode_vs_llama_cpp", "llama.cpp decoding")) if row[k] is not None)
        decoding = f" ({decode:.1f} decoding)" if decode else ""
        report(f"cpu: {r['engine']:<24} {r['weights']:<8} {r['tok_s']:7.1f} tok/s{decoding}{ratios}"
               f"  same outputs {same if same is not None else '-'}/{base['num_prompts']}"
               f"  ({base['threads']} threads)", row, output)


if __name__ == "__main__":
    raise SystemExit(main())
