"""`specserve bench structured`: JSON-schema answers with and without speculation, and what the grammar costs.

MT-bench first turns, each answered under one JSON schema (a title and up to five points),
greedy, at each batch size of `--batch-sizes`: first by the plain engine, then with
`--algorithm` (EAGLE3 on the default model drafts with its shipped head), each engine
built, warmed up, timed and released in turn. A row reports tokens/s, the accept length,
the speedup over plain at the same batch size, the answers token-identical to plain's
and the grammar's host cost per step: the wall time of the grammar's part of the logits
processors (advancing the matchers, the masks at each request's state or at each
draft-tree node, their unpacking) over the steps that carried
a constrained request, against the mean step time. `--free` adds the same rows without a
schema, for what the constraint costs end to end.
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from specserve.bench.prompts import mt_bench_first_turns
from specserve.bench.quality import free_gpu
from specserve.bench.report import report
from specserve.bench.spec_compare import engine_kwargs, spec_counts
from specserve.runner import logits_process
from specserve.spec import worker

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "points"],
          "properties": {"title": {"type": "string", "maxLength": 80},
                         "points": {"type": "array", "maxItems": 5, "items": {"type": "string", "maxLength": 200}}}}
ASK = "\n\nAnswer as JSON with a short title and up to five points."


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench structured")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--algorithm", default="EAGLE3")
    p.add_argument("--spec-args", default="", help="more engine flags for the speculative engine, 'a=1,b=2'")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--num-questions", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--free", action="store_true", help="also run without the schema")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--output", default="bench_structured.jsonl")
    return p


class GrammarClock:
    """Wall seconds in the grammar's part of the processors, and the steps that processed logits."""

    def __init__(self) -> None:
        self.seconds, self.steps = 0.0, 0


@contextmanager
def clocked() -> Iterator[GrammarClock]:
    """Time the grammar's phases (on the scheduler's thread: wall time, the mask threads'
    work inside it) and count every process() call while the block runs."""
    clock = GrammarClock()
    saved = {name: getattr(logits_process, name) for name in ("_grammar_allowed",)}
    saved_process = logits_process.process

    def timed(fn: Callable) -> Callable:
        def run(*args, **kwargs):
            if torch.cuda.is_available():  # the forward's time is not the grammar's (the phase reads back)
                torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - start
        return run

    def counted(*args, **kwargs):
        clock.steps += 1
        return saved_process(*args, **kwargs)

    for name, fn in saved.items():
        setattr(logits_process, name, timed(fn))
    logits_process.process = worker.process = counted  # plain steps (process_rows) and verifies
    try:
        yield clock
    finally:
        for name, fn in saved.items():
            setattr(logits_process, name, fn)
        logits_process.process = worker.process = saved_process


def _run(args, prompts: list[str], bs: int, constrained: bool, **flags) -> dict:
    from specserve import Engine

    engine = Engine(args.model, log_level="warning", device=args.device, dtype=args.dtype, **flags)
    ids = [engine.tokenizer.encode_chat([{"role": "user", "content": p + (ASK if constrained else "")}])
           for p in prompts]
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    if constrained:
        params["json_schema"] = json.dumps(SCHEMA)
    engine.generate(input_ids=[p[::-1] for p in ids[:bs]], sampling_params={**params, "max_new_tokens": 16})
    engine.flush_cache()
    outs: list[dict] = []
    with clocked() as clock:
        start = time.perf_counter()
        for i in range(0, len(ids), bs):
            outs += engine.generate(input_ids=ids[i:i + bs], sampling_params=params)
            engine.flush_cache()
        seconds = time.perf_counter() - start
    del engine
    gc.collect()
    free_gpu()
    _, _, accept = spec_counts(outs)
    tokens = sum(len(o["output_ids"]) for o in outs)
    steps = max(clock.steps, 1)
    return {"seconds": seconds, "tok_s": tokens / seconds, "accept_length": accept,
            "ids": [o["output_ids"] for o in outs], "grammar_ms_per_step": 1e3 * clock.seconds / steps,
            "step_ms": 1e3 * seconds / steps if clock.steps else None}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    prompts = mt_bench_first_turns(args.num_questions)
    spec = {"speculative_algorithm": args.algorithm, "speculative_adaptive": "off", **engine_kwargs(args.spec_args)}
    for constrained in ([True, False] if args.free else [True]):
        for bs in map(int, args.batch_sizes.split(",")):
            plain = _run(args, prompts, bs, constrained)
            fast = _run(args, prompts, bs, constrained, **spec)
            same = sum(a == b for a, b in zip(plain["ids"], fast["ids"]))
            for name, r in (("plain", plain), (args.algorithm, fast)):
                row = {"bench": "structured", "model": args.model, "method": name, "bs": bs,
                       "schema": constrained, **{k: v for k, v in r.items() if k != "ids"},
                       "speedup": r["tok_s"] / plain["tok_s"], "identical": same, "prompts": len(prompts)}
                cost = f", grammar {r['grammar_ms_per_step']:.2f} ms of a {r['step_ms']:.1f} ms step" \
                    if constrained else ""
                report(f"structured: {name:>8} bs {bs:>3} schema {'on ' if constrained else 'off'}: "
                       f"{r['tok_s']:8.1f} tok/s, accept {r['accept_length']:.2f}, "
                       f"{row['speedup']:.2f}x plain, identical {same}/{len(prompts)}{cost}", row, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
