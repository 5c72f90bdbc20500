"""`specserve bench compile`: the same engine with and without --enable-torch-compile, in one run.

Greedy MT-bench first turns at batch size 1 (or --batch-size B), plain decoding or, with
--engine-args, any speculative setting (e.g. the reference's EAGLE-2 + torch.compile).
Prints one summary line: tokens/s of each engine, the ratio, each engine's start-up time
(the compiled one compiles while its CUDA graphs are captured), and how many outputs
were token-identical; appends a JSON line.
"""
from __future__ import annotations

import argparse
import time

from specserve.bench.prompts import mt_bench_first_turns
from specserve.bench.report import report
from specserve.bench.spec_compare import add_run_args, engine_kwargs, spec_counts, timed_run


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench compile")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--engine-args", default="",
                   help="flags of both engines, e.g. 'speculative_algorithm=EAGLE3,speculative_num_steps=3'")
    p.add_argument("--torch-compile-max-bs", type=int, default=32)
    add_run_args(p, num_prompts=20, max_new_tokens=256, output="bench_compile.jsonl")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from specserve import Engine

    common = dict(device=args.device, dtype=args.dtype, log_level="warning",
                  max_total_tokens=args.max_total_tokens, **engine_kwargs(args.engine_args))
    engines, startup = {}, {}
    for compiled in (False, True):
        start = time.perf_counter()
        extra = {"enable_torch_compile": True, "torch_compile_max_bs": args.torch_compile_max_bs} if compiled else {}
        engines[compiled] = Engine(args.model, **common, **extra)
        startup[compiled] = time.perf_counter() - start
    eager = engines[False]
    texts = mt_bench_first_turns(args.num_prompts)
    prompts = [eager.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    runs = {c: timed_run(e, prompts, args.max_new_tokens, args.batch_size) for c, e in engines.items()}
    tok_s = {c: sum(len(o["output_ids"]) for o in outs) / s for c, (s, outs) in runs.items()}
    same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(runs[False][1], runs[True][1]))
    accept = {c: spec_counts(outs)[2] for c, (_, outs) in runs.items()}
    row = {"bench": "compile", "model": args.model, "device": str(eager.scheduler.runner.device),
           "engine_args": args.engine_args, "torch_compile_max_bs": args.torch_compile_max_bs,
           "batch_size": args.batch_size, "num_prompts": len(prompts), "eager_tok_s": tok_s[False],
           "compiled_tok_s": tok_s[True], "ratio": tok_s[True] / tok_s[False], "eager_startup_s": startup[False],
           "compiled_startup_s": startup[True], "eager_accept_length": accept[False],
           "compiled_accept_length": accept[True], "identical_outputs": same}
    report(f"compile: eager {tok_s[False]:.1f} tok/s, compiled {tok_s[True]:.1f} tok/s, ratio {row['ratio']:.2f}x, "
           f"start-up {startup[False]:.0f} s -> {startup[True]:.0f} s, accept len {accept[False]:.2f} / "
           f"{accept[True]:.2f}, {same}/{len(prompts)} identical ({row['device']}, bs={args.batch_size}, "
           f"{args.engine_args or 'plain'})", row, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
