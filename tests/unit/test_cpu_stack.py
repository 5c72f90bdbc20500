"""The decoder stack in one C call (models/cpu_stack.py, kernels/cpu_layers.c) against the
model's own torch path over the same GGUF blocks: prefill, decode, a tree verify and the
captured aux streams agree to float32 rounding, and a verify's rows equal decode's bit for
bit (what keeps speculation lossless over it)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from specserve.core import quant
from specserve.core.forward_batch import ForwardMode
from specserve.kernels import cpu_quant
from specserve.models import gguf_blocks
from specserve.models.cpu_stack import CpuStack
from specserve.models.layers import Linear
from specserve.models.loader import load_model
from tests.unit.model_utils import BareRunner, save_tiny_hf

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler: GGUF weights run dequantized")
PROMPT = [5, 17, 99, 3, 250, 41, 8, 77, 300, 12]
SPLIT = 128  # cpu_layers.c SPLIT_MIN: a row that sees this many keys takes them in two halves
LONG = [(7 * i + 3) % 400 for i in range(SPLIT + 30)]
_PATH_MASK = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)  # 0; 0-1; 0-2-3


def _blocks(w: torch.Tensor, kind: T) -> quant.QuantWeight:
    x = w.detach().numpy().astype(np.float32)
    r = gguf_blocks.repack(quantize(x, kind), kind, *x.shape)
    off = None if r.offset is None else torch.from_numpy(r.offset)
    return quant.QuantWeight(torch.from_numpy(r.q), torch.from_numpy(r.scale), r.group, r.method, off)


def _blocked(kind: str, path, **shape) -> torch.nn.Module:
    """A tiny model held as the CPU serves a GGUF: every projection in blocks (Q4_1,
    down_proj Q8_0), the head too (Q8_0)."""
    model = load_model(save_tiny_hf(kind, path, **shape), torch.float32, torch.device("cpu"), "none")
    for name, layer in model.named_modules():
        if isinstance(layer, Linear):
            layer.hold(_blocks(layer.out_in_weight, T.Q8_0 if "down_proj" in name else T.Q4_1))
    model.head_blocks = _blocks(model.lm_head.weight, T.Q8_0)
    return model


# qwen2: a q/k/v bias. head_dim 16 takes the C attention's head-by-head path; 64 and 128 its
# vector path, six heads a KV head in passes of four and two, one head a KV head alone
SHAPES = {"llama": ("llama", {}), "qwen2": ("qwen2", {}),
          "llama-d64-group6": ("llama", dict(hidden_size=384, num_attention_heads=6, num_key_value_heads=1)),
          "llama-d128": ("llama", dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=2))}


@pytest.fixture(params=list(SHAPES))
def models(request, tmp_path):
    kind, shape = SHAPES[request.param]
    fused = _blocked(kind, tmp_path / "m", **shape)
    fused.cpu_stack = CpuStack.build(fused)
    assert fused.cpu_stack is not None
    plain = _blocked(kind, tmp_path / "m", **shape)
    return fused, plain


def _tree_mask() -> torch.Tensor:
    """root, two children of the root, a grandchild under the first child"""
    return torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)


@pytest.mark.parametrize("prompt", [PROMPT, LONG], ids=["short", "long"])
def test_the_c_stack_follows_the_torch_path(models, prompt):
    fused, plain = models
    runs = [BareRunner(m) for m in (fused, plain)]
    n = len(prompt)
    calls = [dict(rows=[0], prefix_lens=[0], tokens=[prompt]),
             dict(rows=[0], prefix_lens=[n], tokens=[[7]], mode=ForwardMode.DECODE),
             dict(rows=[0], prefix_lens=[n + 1], tokens=[[9, 10, 11, 12]], masks=[_tree_mask()],
                  positions=[[n + 1, n + 2, n + 2, n + 3]], mode=ForwardMode.VERIFY)]
    # a product's x is rounded to int16 (kernels/cpu_quant.py): where the two paths' x differ
    # in their last float bits, a value may round one step (2^-15 of its block's largest)
    # apart, and a wider model sums more such steps into a logit
    atol = 1e-4 * fused.config.hidden_size / 64
    for call in calls:
        got, want = (r.forward(**call) for r in runs)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=atol)
    torch.testing.assert_close(runs[0].pool.k[1], runs[1].pool.k[1], rtol=1e-3, atol=atol)  # layer 0's products in them
    torch.testing.assert_close(runs[0].pool.v[0], runs[1].pool.v[0], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("prompt", [PROMPT, LONG[:SPLIT - 2], LONG], ids=["short", "at-the-split", "long"])
def test_a_verifys_rows_equal_decodes_bit_for_bit(models, prompt):
    """Chain and tree verifies against decode, on either side of the keys' split into halves
    (cpu_layers.c SPLIT_MIN: the verify's rows cross it where the prompt ends just before)."""
    fused, _ = models
    chain, tree, one_by_one = BareRunner(fused), BareRunner(fused), BareRunner(fused)
    for r in (chain, tree, one_by_one):
        r.forward([0], [0], [prompt])
    n = len(prompt)
    together = chain.forward([0], [n], [[7, 8, 9]], mode=ForwardMode.VERIFY)
    apart = torch.cat([one_by_one.forward([0], [n + i], [[t]], mode=ForwardMode.DECODE) for i, t in enumerate([7, 8, 9])])
    assert torch.equal(together, apart)
    # root 7, children 5 and 8, 9 under 8: rows 0, 2 and 3 are the path 7, 8, 9
    branched = tree.forward([0], [n], [[7, 5, 8, 9]], masks=[_PATH_MASK],
                            positions=[[n, n + 1, n + 1, n + 2]], mode=ForwardMode.VERIFY)
    assert torch.equal(branched[[0, 2, 3]], apart)
    both = BareRunner(fused)  # two requests in one decode batch: each row as if alone
    both.forward([0, 1], [0, 0], [prompt, prompt[:4]])
    batched = both.forward([0, 1], [n, 4], [[7], [8]], mode=ForwardMode.DECODE)
    assert torch.equal(batched[0], apart[0])


def test_captured_streams_match_the_torch_paths(models):
    fused, plain = models
    for m in (fused, plain):
        m.aux_layers = (0, 1, 2)
    captures = []
    for m in (fused, plain):
        r = BareRunner(m)
        r.forward([0], [0], [PROMPT])
        fb_hidden = []
        original = m.forward

        def spy(fb, original=original):
            hidden, aux = original(fb)
            fb_hidden.append(aux)
            return hidden, aux

        m.forward = spy
        r.forward([0], [len(PROMPT)], [[7, 8]], mode=ForwardMode.VERIFY)
        captures.append(fb_hidden[0])
    assert len(captures[0]) == 3
    for got, want in zip(*captures):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
