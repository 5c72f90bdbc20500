"""`specserve bench spec`: both engines on the same prompts, in alternating rounds, one
JSON row per prompt set (a tiny random target on the CPU: the row's shape and the
lossless outputs, not speed)."""
from __future__ import annotations

import json

from tests.unit.eagle_utils import tiny_target


def test_bench_spec_rounds_report_medians_and_the_first_round(tmp_path, smollm2_dir) -> None:
    from specserve.bench.spec_compare import main

    target, out = tiny_target(tmp_path / "target"), tmp_path / "spec.jsonl"
    args = ["--model", str(target), "--engine-args", f"tokenizer_path={smollm2_dir}", "--algorithm", "EAGLE3",
            "--random-head", "eagle3", "--sets", "mtbench", "--num-prompts", "2", "--batch-size", "2",
            "--max-new-tokens", "6", "--rounds", "3", "--output", str(out)]
    assert main(args) == 0
    row = json.loads(out.read_text())
    assert row["rounds"] == 3 and len(row["round_speedups"]) == 3
    assert row["first_round_speedup"] == row["round_speedups"][0]
    assert row["speedup"] == sorted(row["round_speedups"])[1]  # the median of three paired ratios
    assert row["identical_outputs"] == 2 and row["accept_length"] >= 1.0
    assert row["plain_tok_s"] > 0 and row["spec_tok_s"] > 0
