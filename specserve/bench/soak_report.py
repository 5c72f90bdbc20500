"""The report of `specserve bench soak`: a table of the passes, one of memory, a line per check.

Owns the presentation only: `pass_summary` counts what one pass sent and got back, and
`print_report` prints it with the RSS table and the checks' PASS/FAIL lines.
"""
from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specserve.bench.soak_client import Outcome
from specserve.bench.soak_server import Memory

if TYPE_CHECKING:  # soak.py imports this module
    from specserve.bench.soak import SoakResult
    from specserve.bench.soak_checks import Check


def pass_summary(outcomes: Sequence[Outcome], seconds: float) -> dict[str, Any]:
    statuses = Counter(str(o.status) if o.status is not None else "none" for o in outcomes)
    tokens = sum(o.completion_tokens for o in outcomes)
    return {
        "seconds": seconds,
        "requests": len(outcomes),
        "streamed": sum(o.stream for o in outcomes),
        "greedy": sum(o.kind == "greedy" for o in outcomes),
        "duplicate_pairs": sum(o.kind == "second" for o in outcomes),
        "hung_up": sum(o.closed_early for o in outcomes),
        "statuses": dict(sorted(statuses.items())),
        "by_route": dict(sorted(Counter(o.route for o in outcomes).items())),
        "completion_tokens": tokens,
        "requests_per_s": len(outcomes) / seconds if seconds else 0.0,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
    }


def _pass_lines(result: SoakResult) -> list[str]:
    head = f"{'':<8}{'s':>6}{'requests':>10}{'streamed':>10}{'greedy':>8}{'dup pairs':>11}{'hung up':>9}" \
           f"{'req/s':>8}{'tok/s':>8}  statuses"
    lines = [head]
    for p in result.passes:
        s = pass_summary(p.outcomes, p.seconds)
        lines.append(f"{p.name:<8}{s['seconds']:>6.0f}{s['requests']:>10}{s['streamed']:>10}{s['greedy']:>8}"
                     f"{s['duplicate_pairs']:>11}{s['hung_up']:>9}{s['requests_per_s']:>8.2f}"
                     f"{s['tokens_per_s']:>8.1f}  {s['statuses']}")
    return lines


def _cell(m: Memory | None) -> str:
    return f"{'-':>18}" if m is None else f"{f'{m.rss_mb:.0f} ({m.shmem_mb:.0f})':>18}"


def _memory_lines(idle: Mapping[str, Memory], result: SoakResult) -> list[str]:
    after = [p.memory for p in result.passes]
    keys = sorted(set(idle).union(*after), key=lambda k: (not k.startswith("http"), k))
    lines = [f"{'RSS (shared), MiB':<24}{'idle':>18}" + "".join(f"{'after ' + p.name:>18}" for p in result.passes)]
    for key in keys:
        lines.append(f"{key:<24}{_cell(idle.get(key))}" + "".join(_cell(a.get(key)) for a in after))
    return lines


def print_report(args: argparse.Namespace, result: SoakResult, verdicts: Sequence[Check], log: Path) -> None:
    print(f"soak: {args.clients} clients x {args.seconds:g} s x 2 passes, server args: "
          f"{args.server_args or '(none)'}, seed {args.seed}, server log {log}")
    if result.passes:
        print("\n".join(_pass_lines(result)))
        print("\n".join(_memory_lines(result.idle_memory, result)))
    for v in verdicts:
        print(v.line())
    print(f"soak: {'PASS' if all(v.ok for v in verdicts) else 'FAIL'}", flush=True)
