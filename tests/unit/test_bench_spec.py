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


def test_the_warm_up_samples_at_the_timed_temperature() -> None:
    """A sampled run warms its sampling kernels up: the warm-up answers (reversed prompts,
    a few tokens) use the timed run's temperature, so no compile falls inside the timing."""
    from types import SimpleNamespace

    from specserve.bench.spec_compare import WARM_TOKENS, timed_run

    calls = []

    def generate(input_ids, sampling_params):
        calls.append((input_ids, sampling_params))
        return [{"output_ids": [7], "meta_info": {}} for _ in input_ids]

    engine = SimpleNamespace(generate=generate, flush_cache=lambda: True)
    timed_run(engine, [[1, 2, 3]], max_new=16, bs=1, temperature=1.0)
    (warm_ids, warm), (ids, timed) = calls
    assert warm_ids == [[3, 2, 1]] and ids == [[1, 2, 3]]
    assert warm["temperature"] == 1.0 and warm["max_new_tokens"] == WARM_TOKENS > 2
    assert timed[0]["temperature"] == 1.0 and timed[0]["max_new_tokens"] == 16
