"""`specserve bench compare`: our engine against Hugging Face transformers `generate`.

Same model directory, same chat-templated prompt ids, greedy, batch size 1, one prompt
after another, in one run. Prints one summary line (tokens/s of each and the ratio) and
appends a JSON line to --output. Also reports how many outputs were token-identical.
`--speculative-algorithm NGRAM --hf-prompt-lookup 10` compares n-gram speculation with
transformers' prompt-lookup decoding, its counterpart.
"""
from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from specserve.bench.prompts import mt_bench_first_turns
from specserve.bench.report import report
from specserve.bench.spec_compare import warm_up


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench compare")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--hf-static-cache", action="store_true", help="transformers with its static cache")
    p.add_argument("--speculative-algorithm", default=None, help="speculation on our side (e.g. NGRAM)")
    p.add_argument("--hf-prompt-lookup", type=int, default=0,
                   help="transformers' prompt-lookup decoding with this many tokens (NGRAM's counterpart)")
    p.add_argument("--output", default="bench_compare.jsonl")
    return p


def _time_ours(engine, prompts: list[list[int]], max_new: int) -> tuple[float, int, list[list[int]]]:
    params = {"temperature": 0, "max_new_tokens": max_new}
    warm_up(engine, prompts, 1)
    outs, start = [], time.perf_counter()
    for ids in prompts:
        outs.append(engine.generate(input_ids=ids, sampling_params=params)["output_ids"])
        engine.flush_cache()  # no cross-prompt cache hits: like-for-like
    return time.perf_counter() - start, sum(map(len, outs)), outs


def _time_hf(model, prompts: list[list[int]], max_new: int, eos: list[int], static: bool, lookup: int):
    dev = next(model.parameters()).device
    kw: dict[str, Any] = {"cache_implementation": "static"} if static else {}
    if lookup:
        kw["prompt_lookup_num_tokens"] = lookup
    gen = dict(do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=eos[0], **kw)
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0]], device=dev), **{**gen, "max_new_tokens": 8})
        outs, start = [], time.perf_counter()
        for ids in prompts:
            out = model.generate(torch.tensor([ids], device=dev), **gen)[0, len(ids):].tolist()
            outs.append(out)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    return time.perf_counter() - start, sum(map(len, outs)), outs


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from transformers import AutoModelForCausalLM

    from specserve import Engine

    engine = Engine(args.model, device=args.device, dtype=args.dtype, log_level="warning",
                    speculative_algorithm=args.speculative_algorithm)
    runner = engine.scheduler.runner
    tok = engine.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in mt_bench_first_turns(args.num_prompts)]
    ours_s, ours_n, ours_out = _time_ours(engine, prompts, args.max_new_tokens)
    from specserve.models.source import resolve_model_dir

    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(args.model), torch_dtype=runner.dtype)
    hf = hf.to(runner.device).eval()
    hf_s, hf_n, hf_out = _time_hf(hf, prompts, args.max_new_tokens, sorted(tok.eos_token_ids), args.hf_static_cache,
                                  args.hf_prompt_lookup)
    same = sum(a == b for a, b in zip(ours_out, hf_out))
    row = {"bench": "compare", "model": args.model, "device": str(runner.device), "dtype": str(runner.dtype),
           "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
           "ours_tok_s": ours_n / ours_s, "hf_tok_s": hf_n / hf_s, "ratio": (ours_n / ours_s) / (hf_n / hf_s),
           "ours_tokens": ours_n, "hf_tokens": hf_n, "identical_outputs": same,
           "torch_threads": torch.get_num_threads(), "speculative_algorithm": args.speculative_algorithm,
           "hf_prompt_lookup": args.hf_prompt_lookup, "hf_static_cache": args.hf_static_cache,
           "cuda_graphs": runner.graphs is not None}
    report(f"compare: specserve {row['ours_tok_s']:.1f} tok/s, transformers {row['hf_tok_s']:.1f} tok/s, "
           f"ratio {row['ratio']:.2f}x ({same}/{len(prompts)} outputs identical, {runner.device}, "
           f"{str(runner.dtype).removeprefix('torch.')}, bs=1, greedy)", row, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
