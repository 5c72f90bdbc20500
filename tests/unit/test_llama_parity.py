"""Our Llama-family model against Hugging Face transformers on the same weights (fp32)."""
from __future__ import annotations

import pytest
import torch

from specserve.models.loader import load_model
from tests.unit.model_utils import BareRunner, save_tiny_hf

transformers = pytest.importorskip("transformers")


def _hf_logits(path, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("kind,extra", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("qwen2", {}),
    ("qwen3", {}),
])
def test_prefill_logits_match_transformers(tmp_path, kind, extra):
    path = save_tiny_hf(kind, tmp_path / kind, **extra)
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = BareRunner(load_model(path, torch.float32, torch.device("cpu"))).forward([0], [0], [ids])
    torch.testing.assert_close(ours, _hf_logits(path, ids), rtol=1e-4, atol=1e-4)


def test_chunked_prefill_and_decode_match_full_prefill(tmp_path):
    """Prefix in the cache + new tokens must give the same logits as one prefill."""
    path = save_tiny_hf("llama", tmp_path / "m")
    model = load_model(path, torch.float32, torch.device("cpu"))
    ids = list(range(3, 33))
    full = BareRunner(model).forward([0], [0], [ids])
    r = BareRunner(model)
    a = r.forward([0], [0], [ids[:17]])
    b = r.forward([0], [17], [ids[17:29]])
    c = r.forward([0], [29], [ids[29:]])  # a decode-shaped step
    torch.testing.assert_close(torch.cat([a, b, c]), full, rtol=1e-5, atol=1e-5)


def test_batched_ragged_extend_matches_single(tmp_path):
    path = save_tiny_hf("qwen2", tmp_path / "m")
    model = load_model(path, torch.float32, torch.device("cpu"))
    seqs = [list(range(5, 5 + n)) for n in (7, 19, 1, 12)]
    singles = [BareRunner(model).forward([0], [0], [s]) for s in seqs]
    batched = BareRunner(model).forward([0, 1, 2, 3], [0, 0, 0, 0], seqs)
    torch.testing.assert_close(batched, torch.cat(singles), rtol=1e-5, atol=1e-5)
