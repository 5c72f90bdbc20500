"""`specserve bench structured` on the CPU, tiny: rows for plain and the speculative engine,
greedy answers identical under the schema, and the grammar's time measured (not zero)."""
from __future__ import annotations

import json

import pytest

from specserve.bench import structured

pytestmark = pytest.mark.slow


def test_structured_bench_writes_measured_rows(tmp_path, smollm2_dir):
    out = tmp_path / "rows.jsonl"
    assert structured.main(["--model", str(smollm2_dir), "--algorithm", "NGRAM", "--batch-sizes", "2",
                            "--num-questions", "2", "--max-new-tokens", "12", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["method"] for r in rows] == ["plain", "NGRAM"]
    for r in rows:
        assert r["identical"] == 2 and r["schema"] and r["tok_s"] > 0
        assert 0 < r["grammar_ms_per_step"] < r["step_ms"]
