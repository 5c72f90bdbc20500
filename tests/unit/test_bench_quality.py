"""`specserve bench quality`: the row it writes, on the real SmolLM2 (two CPU engines)."""
from __future__ import annotations

import json

from specserve.bench import quality


def test_common_prefix():
    assert quality.common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert quality.common_prefix([5], [6]) == 0
    assert quality.common_prefix([1, 2], [1, 2, 3]) == 2


def test_quality_row(smollm2_dir, tmp_path):
    out = tmp_path / "q.jsonl"
    assert quality.main(["--num-questions", "2", "--max-new-tokens", "4", "--output", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["prompts"] == 2 and 0 <= row["identical"] <= row["first_token_equal"] <= 2
    assert 0 <= row["mean_common_prefix"] <= 4 and row["weights"]["method"] == "fp8"
