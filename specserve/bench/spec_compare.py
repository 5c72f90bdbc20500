"""`specserve bench spec`: the same engine with and without speculation, in one run.

Greedy, batch size 1 (one prompt after another) or --batch-size B (all prompts in
batches of B). Prints one summary line per prompt set (tokens/s of each, the ratio, the
mean accept length, the time of a plain decode step and of a speculative step, and
whether outputs were token-identical) and appends JSON lines. `--rounds R` times the two
engines R times, alternating, and reports medians: a short run (a large batch finishes
in a fraction of a second) is noisy from round to round, and the first round is the one
where the governor starts fresh (its ratio is reported apart). `--random-head eagle|eagle3`
drafts with a random head of the real layout for the target (accept length ~1): what the
drafting machinery costs per step, before any head is trained.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from specserve.bench.prompts import humaneval_prompts, mt_bench_first_turns
from specserve.bench.repetitive import repetitive_prompts
from specserve.bench.report import report
from specserve.spec import registry

WARM_TOKENS = 8  # a warm-up answer's length: past the first token, a few decode (or speculative) steps


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench spec")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--algorithm", default="NGRAM", type=str.upper, choices=registry.names())
    p.add_argument("--draft", default=None, help="draft model (STANDALONE, EAGLE, EAGLE3)")
    p.add_argument("--random-head", choices=("eagle", "eagle3"), default=None,
                   help="draft with a random head of this layout, written for the target")
    p.add_argument("--spec-args", default="", help="extra engine flags, e.g. 'speculative_num_draft_tokens=8'")
    p.add_argument("--engine-args", default="", help="flags of both engines, e.g. 'max_running_requests=64'")
    p.add_argument("--sets", default="mtbench,repetitive", help="of mtbench, repetitive, humaneval")
    p.add_argument("--rounds", type=int, default=1, help="time both engines this many times, alternating")
    add_run_args(p, num_prompts=10, max_new_tokens=128, output="bench_spec.jsonl")
    return p


def add_run_args(p: argparse.ArgumentParser, num_prompts: int, max_new_tokens: int, output: str) -> None:
    """The flags of a benchmark that times two engines on the same prompts in one run."""
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-total-tokens", type=int, default=65536,
                   help="KV slots per engine: two engines share the device in one run")
    p.add_argument("--output", default=output)


def warm_up(engine, prompts: list[list[int]], bs: int, temperature: float = 0.0,
            filters: dict | None = None) -> None:
    """Run every prompt *reversed*, batched as the timed run will be, a few tokens each and
    at the timed run's temperature and filters: Triton kernels compile for the paths and shapes they
    will meet (block sizes depend on lengths, and sampling has kernels of its own: a run
    warmed up greedily but timed at T > 0 would compile them inside the timed run, and one
    compile costs as much as many decode steps), while a proposer that learns from traffic
    (NGRAM) never sees a benchmark prompt or its answer before the timed run."""
    for i in range(0, len(prompts), bs):
        engine.generate(input_ids=[p[::-1] for p in prompts[i:i + bs]],
                        sampling_params={"temperature": temperature, "max_new_tokens": WARM_TOKENS, "seed": 0,
                                         **(filters or {})})
    engine.flush_cache()


def timed_run(engine, prompts: list[list[int]], max_new: int, bs: int, temperature: float = 0.0,
              filters: dict | None = None) -> tuple[float, list[dict]]:
    """Warm up, then (seconds, results) of generation in batches of bs, no cross-batch cache
    hits: greedy, or sampled at `temperature` (and `filters`: top_p, top_k, min_p) with
    prompt i seeded i (seeded sampling is reproducible, and speculative sampling reproduces
    it token for token)."""
    warm_up(engine, prompts, bs, temperature, filters)
    outs, start = [], time.perf_counter()
    for i in range(0, len(prompts), bs):
        params = [{"temperature": temperature, "max_new_tokens": max_new, "seed": j, **(filters or {})}
                  for j in range(i, min(i + bs, len(prompts)))]
        outs += engine.generate(input_ids=prompts[i:i + bs], sampling_params=params)
        engine.flush_cache()
    return time.perf_counter() - start, outs


def spec_counts(outs: list[dict]) -> tuple[int, int, float]:
    """(verifies that carried drafts, steps run plainly, accept length) over requests' meta:
    the accept length is tokens per drafted verify (accepted drafts + 1), so steps the
    governor ran without drafts do not dilute it; 1.0 when nothing was drafted."""
    meta = [o["meta_info"] for o in outs]
    verifies = sum(m.get("spec_verify_ct", 0) for m in meta)
    plain = sum(m.get("spec_plain_ct", 0) for m in meta)
    accepted = sum(m.get("spec_accept_token_num", 0) for m in meta)
    return verifies, plain, (accepted + verifies) / verifies if verifies else 1.0


def random_head(args, out_dir: str) -> str:
    from pathlib import Path

    from specserve.models.draft_layouts import save_eagle2, save_eagle3
    from specserve.models.loader import read_hf_config
    from specserve.models.source import resolve_model_dir

    target = resolve_model_dir(args.model)
    if args.random_head == "eagle":
        return str(save_eagle2(Path(out_dir) / "eagle2", target, bias=True, scale=0.02))
    vocab = read_hf_config(target)["vocab_size"]  # SpecForge-style: a draft vocab of at most 32k
    return str(save_eagle3(Path(out_dir) / "eagle3", target, draft_vocab=min(32000, vocab), scale=0.02))


def engine_kwargs(text: str) -> dict[str, str | bool]:
    """'a=1,b=x,c=true' -> {'a': '1', 'b': 'x', 'c': True} (the Engine parses values as its
    flags do; true/false switch a flag on or off)."""
    pairs = (item.split("=", 1) for item in filter(None, text.split(",")))
    switches = {"true": True, "false": False}
    return {key.strip(): switches.get(value.strip().lower(), value.strip()) for key, value in pairs}


def _spec_kwargs(args, draft: str | None) -> dict:
    kw = {"speculative_algorithm": args.algorithm}
    if draft:
        kw["speculative_draft_model_path"] = draft
    return kw | engine_kwargs(args.spec_args)


def _tok_s(run: tuple[float, list[dict]]) -> float:
    seconds, outs = run
    return sum(len(o["output_ids"]) for o in outs) / seconds


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from specserve import Engine

    common = dict(device=args.device, dtype=args.dtype, log_level="warning",
                  max_total_tokens=args.max_total_tokens) | engine_kwargs(args.engine_args)
    plain = Engine(args.model, **common)
    with tempfile.TemporaryDirectory() as tmp:
        draft = random_head(args, tmp) if args.random_head else args.draft
        spec = Engine(args.model, **common, **_spec_kwargs(args, draft))
    sets = {"mtbench": mt_bench_first_turns, "repetitive": repetitive_prompts, "humaneval": humaneval_prompts}
    for name in args.sets.split(","):
        texts = sets[name](args.num_prompts)
        prompts = [plain.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
        rounds = [(timed_run(plain, prompts, args.max_new_tokens, args.batch_size),
                   timed_run(spec, prompts, args.max_new_tokens, args.batch_size)) for _ in range(args.rounds)]
        # paired rounds run back to back, so their ratio is steadier than a ratio of medians
        ratios = [_tok_s(s) / _tok_s(p) for p, s in rounds]
        spec_outs = [o for _, (_, outs) in rounds for o in outs]
        verifies, plain_steps, accept = spec_counts(spec_outs)
        (_, plain_out), (_, spec_out) = rounds[0]
        same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(plain_out, spec_out))
        plain_s, spec_s = sum(p[0] for p, _ in rounds), sum(s[0] for _, s in rounds)
        n_plain = sum(len(o["output_ids"]) for (_, outs), _ in rounds for o in outs)
        row = {"bench": "spec", "set": name, "algorithm": args.algorithm, "model": args.model,
               "device": plain.server_info()["device"], "batch_size": args.batch_size,
               "num_prompts": len(prompts), "rounds": args.rounds,
               "plain_tok_s": statistics.median(_tok_s(p) for p, _ in rounds),
               "spec_tok_s": statistics.median(_tok_s(s) for _, s in rounds),
               "speedup": statistics.median(ratios), "round_speedups": ratios, "first_round_speedup": ratios[0],
               "accept_length": accept, "plain_steps_fraction": plain_steps / max(verifies + plain_steps, 1),
               # per batch step, prefill included: decode-step cost vs draft + verify cost
               "plain_step_ms": 1e3 * plain_s / max(n_plain / args.batch_size, 1),
               "spec_step_ms": 1e3 * spec_s / max((verifies + plain_steps) / args.batch_size, 1),
               "identical_outputs": same, "spec_args": args.spec_args, "engine_args": args.engine_args,
               "random_head": args.random_head}
        spread = f", {args.rounds} rounds, first {ratios[0]:.2f}x" if args.rounds > 1 else ""
        report(f"spec[{name}] {args.algorithm}: plain {row['plain_tok_s']:.1f} tok/s, spec "
               f"{row['spec_tok_s']:.1f} tok/s, speedup {row['speedup']:.2f}x{spread}, accept len "
               f"{row['accept_length']:.2f}, step {row['plain_step_ms']:.2f} -> {row['spec_step_ms']:.2f} ms, "
               f"{same}/{len(prompts)} identical ({row['device']}, bs={args.batch_size})", row, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
