"""`specserve bench quality`: the row it writes, on the real SmolLM2 (two CPU engines), and
bench/score.py's log-probabilities at every position."""
from __future__ import annotations

import json

import torch

from specserve.bench import quality, score
from specserve.core.forward_batch import ForwardMode
from specserve.models.loader import load_model
from tests.unit.model_utils import BareRunner


def test_common_prefix():
    assert quality.common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert quality.common_prefix([5], [6]) == 0
    assert quality.common_prefix([1, 2], [1, 2, 3]) == 2


def test_quality_row(smollm2_dir, tmp_path):
    out = tmp_path / "q.jsonl"
    argv = ["--model", str(smollm2_dir), "--num-questions", "2", "--max-new-tokens", "4", "--kl-questions", "1",
            "--output", str(out)]
    assert quality.main(argv) == 0
    row = json.loads(out.read_text())
    assert row["prompts"] == 2 and 0 <= row["identical"] <= row["first_token_equal"] <= 2
    assert 0 <= row["mean_common_prefix"] <= 4 and row["weights"]["method"] == "fp8"
    assert row["kl_questions"] == 1 and 0 < row["mean_kl"] < 0.5, row["mean_kl"]  # fp8's rounding: small, not 0


def test_position_logprobs_are_the_prefills_at_every_position(smollm2_dir):
    """One prefill's log-softmax at each position, as the tests' hand-driven runner computes
    it; a model's KL against itself is 0."""
    model = load_model(smollm2_dir, torch.float32, torch.device("cpu"), "none")
    ids = [1, 504, 3458, 282, 4057, 314, 260, 1345]
    got = score.position_logprobs(model, ids)
    want = BareRunner(model).forward([0], [0], [ids], mode=ForwardMode.EXTEND).float().log_softmax(-1)
    assert got.shape == (len(ids), model.config.vocab_size)
    torch.testing.assert_close(got, want)
    assert score.mean_kl(got, got) == 0.0
