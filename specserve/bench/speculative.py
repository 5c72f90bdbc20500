"""`specserve bench speculative`: SGLang's bench_speculative sweep, in one process.

For every batch size and every (steps, topk, num_draft_tokens) setting, MT-bench prompts
run greedily through an Engine with that setting; the baseline row (no speculation) runs
first. Each row reports tokens/s, the accept length and the time of one batch step, so
speed = accept length / step time can be read off directly. Prints a summary line per
row, appends JSON lines and draws tokens/s against batch size per setting (PNG).
"""
from __future__ import annotations

import argparse
import tempfile

from specserve.bench.prompts import mt_bench_first_turns
from specserve.bench.report import report
from specserve.bench.spec_compare import random_head, spec_counts, timed_run
from specserve.spec import registry


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench speculative")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--algorithm", default="NGRAM", type=str.upper, choices=registry.names())
    p.add_argument("--draft", default=None)
    p.add_argument("--random-head", choices=("eagle", "eagle3"), default=None)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--settings", default="1,1,2;3,1,4;5,4,8",
                   help="';'-separated steps,topk,num_draft_tokens (NGRAM: only N is used)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-total-tokens", type=int, default=65536)
    p.add_argument("--output", default="bench_speculative.jsonl")
    p.add_argument("--plot", default="bench_speculative.png")
    return p


def _engine_kwargs(args, setting: tuple[int, ...] | None, draft: str | None) -> dict:
    """setting: (steps, topk, num_draft_tokens) as parsed from --settings; None: no speculation."""
    kw = dict(device=args.device, dtype=args.dtype, log_level="warning", max_total_tokens=args.max_total_tokens,
              max_running_requests=max(int(b) for b in args.batch_sizes.split(",")))
    if setting is None:
        return kw
    steps, topk, n = setting
    kw["speculative_algorithm"] = args.algorithm
    if not registry.get(args.algorithm).tree_flags:  # NGRAM: its tree comes from its own flags
        return {**kw, "speculative_num_draft_tokens": n}
    return {**kw, "speculative_draft_model_path": draft, "speculative_num_steps": steps,
            "speculative_eagle_topk": topk, "speculative_num_draft_tokens": n}


def _measure(engine, prompts: list[list[int]], bs: int, max_new: int) -> tuple[float, int, int, float]:
    """(seconds, output tokens, decode steps summed over requests, accept length)."""
    seconds, outs = timed_run(engine, prompts, max_new, bs)
    verifies, plain, accept = spec_counts(outs)
    return seconds, sum(len(o["output_ids"]) for o in outs), verifies + plain, accept


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from specserve import Engine

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    settings = [tuple(int(x) for x in s.split(",")) for s in args.settings.split(";")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        draft = random_head(args, tmp) if args.random_head else args.draft
        for setting in [None, *settings]:
            for bs in sizes:  # a fresh engine each time: NGRAM's trie must not learn the answers
                engine = Engine(args.model, **_engine_kwargs(args, setting, draft))
                texts = mt_bench_first_turns(args.num_prompts)
                prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
                rows.append(_row(args, engine, prompts, bs, setting))
                del engine
    _plot(rows, args.plot)
    return 0


def _row(args, engine, prompts, bs: int, setting) -> dict:
    seconds, tokens, verifies, accept = _measure(engine, prompts, bs, args.max_new_tokens)
    name = "plain" if setting is None else f"{args.algorithm} {setting[0]},{setting[1]},{setting[2]}"
    steps = verifies / bs if verifies else tokens / bs
    row = {"bench": "speculative", "model": args.model, "setting": name, "batch_size": bs,
           "device": engine.server_info()["device"], "tok_s": tokens / seconds, "accept_length": accept,
           "step_ms": 1e3 * seconds / max(steps, 1), "num_prompts": len(prompts),
           "max_new_tokens": args.max_new_tokens, "random_head": args.random_head}
    report(f"speculative[{name}] bs={bs}: {row['tok_s']:.1f} tok/s, accept len {accept:.2f}, "
           f"step {row['step_ms']:.2f} ms ({row['device']})", row, args.output)
    return row


def _plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["setting"] for r in rows):
        pts = [(r["batch_size"], r["tok_s"]) for r in rows if r["setting"] == name]
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.set(xscale="log", xlabel="batch size", ylabel="tokens/s", title="speculative sweep")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")
