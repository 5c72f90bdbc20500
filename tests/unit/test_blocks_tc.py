"""q4 and q8 blocks at 3 or more tokens of half x on tensor cores (kernels/blocks_tc.py)
against F.linear(x, qw.dequantize(x.dtype)): GGUF's one scale a block and AWQ/GPTQ's groups
of 64 to 256 columns held as q4, q8 with a scale every 16 or 32 columns, with and without
offsets, bf16 and fp16, a ragged last scale group and row block, more than
32 tokens, a residual, split rows, other launch shapes, and which inputs take the path. Compiled on CUDA and under TRITON_INTERPRET=1 on the CPU."""
from __future__ import annotations

import pytest
import torch

from tests.unit.triton_interp import DEV  # first: sets TRITON_INTERPRET where there is no GPU

# isort: split
from specserve.core.quant import Q4, Q8, QuantWeight
from specserve.kernels import blocks, blocks_tc, split_k
from tests.unit.test_blocks_kernel import _blocks, _check


def _q4(n: int, k: int, group: int, offset: bool, seed: int) -> QuantWeight:
    """Random q4 blocks whose scales cover `group` columns, the last one fewer where k is not
    a multiple of it (as core/quant.py `int4_to_q4` holds AWQ's groups)."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    scale = (torch.rand(n, groups, generator=gen) * 0.01 + 1e-3).half()
    zeros = (-torch.rand(n, groups, generator=gen) * 0.05).half() if offset else None
    data = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    return QuantWeight(data.to(DEV), scale.to(DEV), group, Q4, None if zeros is None else zeros.to(DEV))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group,offset,tokens", [(32, True, 3), (32, False, 16), (32, True, 40), (64, True, 3),
                                                 (64, False, 16), (128, True, 17), (128, True, 40), (128, False, 8),
                                                 (256, True, 12)])
def test_kernel_equals_the_reference(group, offset, tokens, dtype):
    qw = _q4(40, 576 if group <= 128 else 1024, group, offset, seed=tokens)  # 576: 4.5 groups of 128, 2.25 steps
    x = torch.randn(tokens, qw.shape[1], device=DEV).to(dtype)
    _check(blocks_tc.tc_matmul(x, qw), x, qw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group,offset,tokens", [(32, False, 4), (16, False, 16), (32, True, 40)])
def test_q8_equals_the_reference(group, offset, tokens, dtype):
    """q8 (GGUF's Q8_0, Q6_K's 16-column scales, Q5_x's offsets), a ragged last K step (9
    blocks of 32 columns, 4 a step) and row block; bytes from -128 to 127."""
    qw = _blocks(Q8, 40, 288, group, offset, seed=tokens)
    x = torch.randn(tokens, 288, device=DEV).to(dtype)
    assert blocks_tc.takes(x, qw)
    _check(blocks_tc.tc_matmul(x, qw), x, qw)


def test_residual_and_float32_out():
    qw = _q4(48, 512, 128, True, seed=3)
    x = torch.randn(9, 512, device=DEV).bfloat16()
    r = torch.randn(9, 48, device=DEV).bfloat16()
    _check(blocks.blocks_matmul(x, qw, residual=r), x, qw, r)
    got = blocks_tc.tc_matmul(x, qw, residual=r, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, blocks_tc.tc_matmul(x, qw, residual=r).float())


@pytest.mark.parametrize("group", [32, 64, "q8"])
def test_split_rows_and_launch_shapes_agree(group):
    """Rows split over programs (a second launch adds the parts), one program a row tile,
    and other tile shapes give the same sums up to their fp32 order."""
    qw = _blocks(Q8, 32, 16 * 128, 32, False, seed=6) if group == "q8" else _q4(32, 16 * 128, group, True, seed=6)
    x = torch.randn(6, 16 * 128, device=DEV).bfloat16()
    xw = x.float().abs() @ qw.dequantize(torch.float32).abs().t()
    assert split_k.split_for(2, 16, 512) == 8  # the default launch splits this layer
    base = blocks_tc.tc_matmul(x, qw).float()
    runs = [blocks_tc.tc_matmul(x, qw, launch=lc) for lc in ((16, 2, 4, 3, 1), (16, 1, 4, 1, 8), (32, 4, 8, 2, 1))]
    for got in runs:
        assert bool(((got.float() - base).abs() <= 2**-7 * base.abs() + 1e-5 * xw + 1e-6).all())
    _check(runs[0], x, qw)


@pytest.mark.parametrize("group", [32, 128])
def test_the_dot_kernel_and_this_one_agree(group):
    """blocks.py's dot kernel (a launch given keeps it there) rounds each weight to bf16
    first; with weights, scales and offsets exact in bf16 the two differ only by their fp32
    sum order."""
    qw = _blocks(Q4, 48, 512, group, True, seed=5, exact_bf16=True)
    x = torch.randn(7, 512, device=DEV).bfloat16()
    old = blocks.blocks_matmul(x, qw, launch=blocks.config(48, 512, 32, 7)).float()
    new = blocks.blocks_matmul(x, qw).float()
    assert bool(((old - new).abs() <= 2**-7 * old.abs() + 1e-6).all())


def test_what_takes_the_tensor_core_path():
    qw = _q4(8, 256, 128, True, seed=1)
    x = torch.randn(blocks_tc.MIN_TOKENS, 256, device=DEV).bfloat16()
    assert blocks_tc.takes(x, qw) and blocks_tc.takes(x.half(), qw)
    assert not blocks_tc.takes(x[:-1], qw)  # blocks_x16.py's
    assert not blocks_tc.takes(x.float(), qw)
    assert blocks_tc.takes(x, qw._replace(group=32))  # GGUF's Q4_0, Q4_1, Q4_K
    assert not blocks_tc.takes(x, qw._replace(group=96)) and not blocks_tc.takes(x, qw._replace(group=512))
    q8 = QuantWeight(torch.zeros(8, 256, dtype=torch.int8, device=DEV), torch.ones(8, 8, device=DEV), 32, Q8, None)
    x8 = torch.randn(blocks_tc.MIN_TOKENS_Q8, 256, device=DEV).bfloat16()
    assert blocks_tc.takes(x8, q8) and blocks_tc.takes(x8, q8._replace(group=16))
    assert not blocks_tc.takes(x8[:-1], q8)  # blocks_x16.py's
