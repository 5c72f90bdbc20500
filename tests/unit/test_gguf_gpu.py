"""A GGUF's blocks on a GPU (`--quantization gguf`, models/gguf_serve.py; kernel:
kernels/blocks.py, tested on its own in test_blocks_kernel.py): which device serves them
by default, random-weight blocks for benchmarks, and, on a GPU, a tiny GGUF served in its
blocks: its layers hold them on the device, its logits are the CPU blocks model's up to
float32 rounding, and NGRAM over it is greedy token-identical to plain decoding of the
same blocks (float32 activations)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve import Engine
from specserve.core import quant
from specserve.models import gguf_serve
from specserve.models.layers import Linear
from specserve.models.loader import load_model, random_model
from tests.unit.model_utils import BareRunner, save_tiny_hf

CUDA = torch.device("cuda")




def test_random_weights_take_q4_1_blocks(tmp_path):
    tiny = save_tiny_hf("llama", tmp_path / "tiny")
    model = random_model(tiny, torch.float32, torch.device("cpu"), quantization="gguf")
    held = [m.quantized for m in model.modules() if isinstance(m, Linear)]
    assert held and all(qw is not None and qw.method == quant.Q4 and qw.zeros is not None for qw in held)
    assert model.head_blocks is not None and model.head_blocks.method == quant.Q8
    assert model.weight_quant.method == "gguf"
    with torch.no_grad():  # the blocks' own values: what the kernels multiply
        q = held[0]
        assert q.scale.dtype == torch.float32 and torch.equal(q.scale, q.scale.half().float())


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.fixture(scope="module")
def tiny_blocks(tmp_path_factory) -> Path:
    """A tiny llama converted from a GGUF whose projections are Q4_1 (q4 with offsets) and
    whose down projections are Q8_0 (q8): both of the GPU kernel's forms."""
    from gguf import GGMLQuantizationType as Q

    from specserve.models.gguf import convert_gguf
    from tests.unit.test_gguf import tiny_model, write_tiny_gguf

    tmp = tmp_path_factory.mktemp("gguf_gpu")
    model = tiny_model("llama", hidden_size=128, intermediate_size=256, tie_word_embeddings=True)
    qtypes = {f"blk.{i}.{name}.weight": Q.Q4_1 for i in range(2)
              for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")}
    qtypes |= {f"blk.{i}.ffn_down.weight": Q.Q8_0 for i in range(2)}
    write_tiny_gguf(tmp / "tiny.gguf", model, "llama", qtypes=qtypes)
    convert_gguf(tmp / "tiny.gguf", tmp / "tiny")
    return tmp / "tiny"


def test_a_gpu_serves_the_blocks_when_asked(tiny_blocks):
    assert gguf_serve.resolve(gguf_serve.GGUF, tiny_blocks, CUDA)
    assert not gguf_serve.resolve(None, tiny_blocks, CUDA)  # float weights stay a GPU's default
    assert gguf_serve.resolve(None, tiny_blocks, torch.device("cpu")) == gguf_serve.cpu_quant.available()


@needs_gpu
def test_a_gguf_holds_its_blocks_on_the_gpu(tiny_blocks):
    gpu = load_model(tiny_blocks, torch.float32, CUDA, "gguf")
    cpu = load_model(tiny_blocks, torch.float32, torch.device("cpu"), "gguf")
    held = [m.quantized for m in gpu.modules() if isinstance(m, Linear)]
    assert len(held) == 4 * gpu.config.num_layers and all(qw.data.is_cuda for qw in held)
    assert {qw.method for qw in held} == {quant.Q4, quant.Q8}
    assert all(qw.scale.dtype == torch.float16 for qw in held)  # Q4_1 and Q8_0 store float16 scales
    prompt = [1, 5, 9, 14, 3, 7, 2]
    got, want = BareRunner(gpu), BareRunner(cpu)
    for prefix, tokens in ((0, prompt), (len(prompt), [11])):  # a prefill, then a one-token decode
        torch.testing.assert_close(got.forward([0], [prefix], [tokens]).cpu(), want.forward([0], [prefix], [tokens]),
                                   rtol=1e-4, atol=1e-4)


@needs_gpu
def test_ngram_over_the_blocks_on_a_gpu_is_lossless(tiny_blocks):
    prompts = [[1, 5, 9, 14, 5, 9, 14, 5, 9], [1, 3, 4, 3, 4, 3, 4, 3]]
    greedy = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    outs = []
    for flags in ({}, {"speculative_algorithm": "NGRAM", "speculative_adaptive": "off"}):
        with Engine(str(tiny_blocks), log_level="warning", quantization="gguf", dtype="float32",
                    max_total_tokens=4096, **flags) as engine:
            assert engine.server_info()["weight_quantization"]["method"] == "gguf"
            outs.append([o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=greedy)])
            assert engine.kv_leak() is None
    assert outs[0] == outs[1]
