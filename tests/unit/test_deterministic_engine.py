"""--enable-deterministic-inference end to end on a CPU, in bf16.

With the mode on, every speculative algorithm gives plain decoding's tokens bit for bit,
and a request's output does not depend on its batch: on SmolLM2 with real prompts, plain
decoding at batch 1 and at batch 5 (greedy and seeded sampling mixed), NGRAM, STANDALONE
(the target as its own draft) and EAGLE3 (the shipped head) at batch 5; on a tiny random
target, EAGLE and MTP with perfect drafts (long accepted runs). SmolLM2 runs in its GGUF's
blocks, as the CPU serves it (their kernels keep the mode's contract). Configurations the
mode does not cover are refused at start-up.
"""
from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.core.config import ConfigError
from specserve.kernels import cpu_quant
from tests.unit.eagle_utils import clean, perfect_engine, prompts

pytestmark = pytest.mark.slow

DET = {"dtype": "bfloat16", "enable_deterministic_inference": True}
PROMPTS = [
    "Copy this list: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry.",
    "Write a short poem about the sea.",
    "What is the capital of France? Explain briefly.",
    "Count from one to twenty, separated by commas.",
    "Give three tips for staying healthy.",
]
N = 20
PARAMS = [{"temperature": 0, "max_new_tokens": N}] * 4 + [{"temperature": 0.8, "seed": 5, "max_new_tokens": N}]
ALGORITHMS = {
    "NGRAM": {"speculative_algorithm": "NGRAM"},
    "STANDALONE": {"speculative_algorithm": "STANDALONE", "speculative_num_steps": 3,
                   "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6},
    "EAGLE3": {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3, "speculative_eagle_topk": 2,
               "speculative_num_draft_tokens": 6},
}


def _generate(engine: Engine, ids: list[list[int]], params: list[dict]) -> list[list[int]]:
    outs = engine.generate(input_ids=ids, sampling_params=params)
    clean(engine)
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def plain(smollm2_dir) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, plain decoding's outputs at batch 5), having checked them at batch 1."""
    engine = Engine(str(smollm2_dir), log_level="warning", **DET)
    if cpu_quant.available():  # the GGUF's blocks on the CPU: their kernels compute each row alone
        assert engine.server_info()["weight_quantization"]["method"] == "gguf"
    ids = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    batched = _generate(engine, ids, PARAMS)
    for i in (1, 4):  # greedy and seeded sampling, alone
        assert _generate(engine, ids[i:i + 1], PARAMS[i:i + 1]) == batched[i:i + 1], i
    return ids, batched


@pytest.mark.parametrize("algo", list(ALGORITHMS))
def test_speculation_equals_plain_decoding_bit_for_bit(algo, plain, smollm2_dir):
    ids, want = plain
    target = "smollm2-135m" if algo == "EAGLE3" else str(smollm2_dir)  # the catalogue name finds the shipped head
    draft = {"speculative_draft_model_path": str(smollm2_dir)} if algo == "STANDALONE" else {}
    engine = Engine(target, log_level="warning", speculative_adaptive="off", **DET, **ALGORITHMS[algo], **draft)
    assert _generate(engine, ids, PARAMS) == want


@pytest.mark.parametrize("kind", ["EAGLE", "MTP-deepseek"])
def test_perfect_drafts_equal_plain_decoding_bit_for_bit(kind, tmp_path, smollm2_dir):
    engine = perfect_engine(kind, tmp_path, smollm2_dir, "tree", **DET)
    ids, greedy = prompts(4, seed=3), [{"temperature": 0, "max_new_tokens": N}] * 4
    got = engine.generate(input_ids=ids, sampling_params=greedy)
    clean(engine)
    assert sum(o["meta_info"]["completion_tokens"] for o in got) > 2 * sum(
        o["meta_info"]["spec_verify_ct"] for o in got)  # long accepted runs
    plain = Engine(str(tmp_path / "target"), tokenizer_path=str(smollm2_dir), log_level="warning", **DET)
    assert _generate(plain, ids, greedy) == [o["output_ids"] for o in got]


def test_an_awq_target_in_the_mode(smollm2_dir, tmp_path):
    """AWQ's 4-bit weights (held as q4 blocks, as a GGUF's are) in the mode: NGRAM equals
    plain decoding bit for bit, and batch 5 equals each request alone."""
    from pathlib import Path

    from tests.unit.test_int4_model import write_int4

    write_int4(Path(smollm2_dir), tmp_path / "awq", "awq", group=64)
    plain = Engine(str(tmp_path / "awq"), log_level="warning", **DET)
    assert plain.server_info()["weight_quantization"]["method"] == "awq"
    ids = [plain.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    want = _generate(plain, ids, PARAMS)
    assert _generate(plain, ids[:1], PARAMS[:1]) == want[:1]
    ngram = Engine(str(tmp_path / "awq"), log_level="warning", speculative_adaptive="off", **DET,
                   **ALGORITHMS["NGRAM"])
    assert _generate(ngram, ids, PARAMS) == want


@pytest.mark.parametrize("flags", [{"tp_size": 2}, {"enable_torch_compile": True},
                                   {"speculative_algorithm": "NGRAM", "speculative_accept_threshold_acc": 0.5}])
def test_what_the_mode_does_not_cover_is_refused(flags):
    with pytest.raises(ConfigError, match="--enable-deterministic-inference"):
        Engine("smollm2-135m", enable_deterministic_inference=True, **flags)


def test_a_gguf_on_a_gpu_in_float32_is_refused(smollm2_dir):
    """On a GPU the mode multiplies blocks by int16 dot products, which take half activations."""
    from specserve.models import gguf_serve

    with pytest.raises(ConfigError, match="--enable-deterministic-inference on a GPU needs bf16 or fp16"):
        gguf_serve.resolve("gguf", smollm2_dir, torch.device("cuda"), allowed=False)
