"""One to four tokens of half-precision x on q4 and q8 blocks (kernels/blocks_x16.py): x's
int16 pairs and their orders, and the layer against F.linear of x as rounded to int16
(tight) and of x as given (the blocks' bound), with and without offsets, AWQ's shared
scales (a ragged last one), q8's 16-column scales, a residual, bf16 and fp16; a verify's
rows against one-token products, bit for bit. Compiled on CUDA, under TRITON_INTERPRET=1
on the CPU (where dp2a is written out in integer ops)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.unit.triton_interp import DEV  # first: sets TRITON_INTERPRET where there is no GPU

# isort: split
from specserve.core.quant import Q4, Q8, QuantWeight
from specserve.kernels import blocks_tc, blocks_x16
from specserve.kernels.blocks import blocks_matmul
from tests.unit.test_blocks_kernel import _blocks, _check


def _unpack(xq: torch.Tensor, xs: torch.Tensor, q8: bool = False) -> torch.Tensor:
    """x [1, K] as the pairs hold it. q4's order: pair (w, j) of block g at g * 16 + 4 j + w
    holds columns 4 w + 2 j and + 1 (j < 2), 16 + 4 w + 2 (j - 2) and + 1 (j >= 2); q8's:
    pair (w, j) at g * 16 + 8 j + w holds columns 4 w + 2 j and + 1."""
    words, pairs_a_word = (8, 2) if q8 else (4, 4)
    pairs = xq.cpu().view(-1, pairs_a_word, words)  # [g, j, w]
    lo = ((pairs << 16) >> 16).float()
    hi = (pairs >> 16).float()
    q = torch.empty(pairs.shape[0], 32)
    for j in range(pairs_a_word):
        col = 4 * torch.arange(words) + 2 * (j % 2) + 16 * (j // 2)
        q[:, col] = lo[:, j]
        q[:, col + 1] = hi[:, j]
    return (q * xs.cpu().reshape(-1)[:, None]).view(1, -1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantized_x_holds_x(dtype):
    """Each value within 2^-16 of its block's largest |x| (half a step of the scale), sums
    of x as given, and an all-zero block scaled 1."""
    torch.manual_seed(0)
    x = (torch.randn(1, 40 * 32) * torch.logspace(-3, 2, 40).repeat_interleave(32)).to(dtype)
    x[0, 64:96] = 0
    xq, xs, xsum = blocks_x16.quantize(x.to(DEV))
    blocks = x.float().view(-1, 32)
    amax = blocks.abs().amax(dim=1)
    assert xq.shape == (1, 40 * 16) and xs.shape == xsum.shape == (1, 40)
    assert float(xs[0, 2]) == 1.0
    err = (_unpack(xq, xs) - x.float()).abs().view(-1, 32)
    assert bool((err <= amax[:, None] * 2**-16 * 1.01).all())
    torch.testing.assert_close(xsum.cpu().reshape(-1), blocks.sum(dim=1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method,group,offset,k", [(Q4, 32, True, 320), (Q4, 32, False, 320), (Q4, 128, True, 576),
                                                   (Q4, 64, True, 2048), (Q8, 32, False, 320), (Q8, 32, True, 320),
                                                   (Q8, 16, False, 576)])
def test_one_token_equals_linear_of_the_rounded_x(method, group, offset, k, dtype, residual):
    padded = -(-k // group) * group  # a ragged last scale (576 = 4.5 groups of 128), as int4_to_q4 makes it
    qw = _blocks(method, 44, padded, group, offset, seed=k + group)  # 44 rows: a ragged row block
    qw = qw._replace(data=qw.data[:, : k // 2 if method == Q4 else k].contiguous())
    x = torch.randn(1, k, device=DEV).to(dtype)
    r = torch.randn(1, 44, device=DEV).to(dtype) if residual else None
    assert blocks_x16.takes(x, qw)
    got = blocks_matmul(x, qw, residual=r)
    _check(got, x, qw, r)
    xq, xs, _ = blocks_x16.quantize(x, q8=method == Q8)
    lin = F.linear(_unpack(xq, xs, method == Q8).to(DEV), qw.dequantize(torch.float32)).to(dtype).float()  # the exact form
    y = lin if r is None else (r.float() + lin).to(dtype).float()
    ulp = torch.finfo(dtype).eps * (lin.abs() + y.abs())  # one of the product's rounding, one of the sum's
    xw = x.float().abs() @ qw.dequantize(torch.float32).abs().t()  # fp32 sums of other orders
    assert bool(((got.float() - y).abs() <= ulp + 2**-16 * xw).all()), (got.float() - y).abs().max()


def test_a_tile_wider_than_the_row_and_launch_shapes():
    """SmolLM2's width (18 blocks) under one tile of 32, and other launch shapes, agree."""
    qw = _blocks(Q4, 64, 576, 32, True, seed=3)
    x = torch.randn(1, 576, device=DEV).bfloat16()
    base = blocks_x16.gemv_x16(x, qw)
    for launch in ((2, 32, 1), (8, 32, 1), (4, 64, 1), (4, 128, 4)):
        torch.testing.assert_close(blocks_x16.gemv_x16(x, qw, launch=launch), base, rtol=2**-7, atol=1e-5)


def test_what_takes_the_int16_path():
    qw = QuantWeight(torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4, 1), 32, Q4)
    assert blocks_x16.takes(torch.zeros(1, 32, dtype=torch.bfloat16), qw)
    assert blocks_x16.takes(torch.zeros(blocks_tc.MIN_TOKENS - 1, 32, dtype=torch.float16), qw)
    assert not blocks_x16.takes(torch.zeros(blocks_tc.MIN_TOKENS, 32, dtype=torch.bfloat16), qw)  # tensor cores
    assert not blocks_x16.takes(torch.zeros(1, 32), qw)  # fp32 x keeps its fp32 products
    awq = QuantWeight(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 1), 128, Q4)  # AWQ's groups held as q4
    assert blocks_x16.takes(torch.zeros(2, 128, dtype=torch.bfloat16), awq)
    assert not blocks_x16.takes(torch.zeros(3, 128, dtype=torch.bfloat16), awq)  # blocks_tc.py's tensor cores
    q8 = QuantWeight(torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 2), 16, Q8)
    assert blocks_x16.takes(torch.zeros(blocks_tc.MIN_TOKENS_Q8 - 1, 32, dtype=torch.bfloat16), q8)
    assert not blocks_x16.takes(torch.zeros(blocks_tc.MIN_TOKENS_Q8, 32, dtype=torch.bfloat16), q8)  # tensor cores
    assert not blocks_x16.takes(torch.zeros(1, 32, dtype=torch.bfloat16), q8._replace(zeros=torch.ones(4, 2)))


@pytest.mark.parametrize("method", [Q4, Q8])
@pytest.mark.parametrize("gated", [False, True])
def test_the_norm_and_silu_fused_equal_the_separate_launches(gated, method):
    """`kernels.gemv`'s pre-norm in the rounding launch and SiLU*mul in the product's
    epilogue, against the norm, the product and SiLU*mul as launches of their own (the
    path blocks.py's kernel takes), in bf16: equal up to a last-bit change of a normed
    value meeting the int16 rounding, and the products' orders."""
    from specserve import kernels
    from specserve.kernels.blocks import blocks_matmul as product

    rows = 74 if gated else 64  # gated: 37 gate rows and their up rows, a ragged last program
    qw = _blocks(method, rows, 256, 32, True, seed=7, exact_bf16=True)
    x = torch.randn(1, 256, device=DEV).bfloat16()
    nw = (torch.rand(256, device=DEV) + 0.5).bfloat16()
    r = None if gated else torch.randn(1, 64, device=DEV).bfloat16()
    with kernels.fused_kernels(True):
        got = kernels.gemv(x, qw, norm_weight=nw, eps=1e-5, residual=r, gated=gated)
    normed = kernels.rms_norm(x, nw, 1e-5)
    y = product(normed, qw, residual=r)
    ref = kernels.silu_and_mul(y) if gated else y
    assert got.shape == ref.shape == (1, 37 if gated else 64) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("tokens", [2, 3, 4])
def test_a_row_of_a_few_tokens_equals_that_token_alone(tokens, gated):
    """Each row of a T-token product (a verify, a draft step; --enable-deterministic-inference
    at any T) is the one-token product of that row bit for bit (the norm fused, a residual
    or SiLU*mul, shared scales): its int16 rounding is its own and its sums take the same
    operations in the same order. GGUF's q4 and q8 blocks, AWQ's groups (gated)."""
    method, group = (Q4, 128) if gated else ((Q4, 32) if tokens != 3 else (Q8, 32))
    qw = _blocks(method, 74 if gated else 40, 512, group, True, seed=tokens)
    x = torch.randn(tokens, 512, device=DEV).bfloat16()
    nw = (torch.rand(512, device=DEV) + 0.5).bfloat16()
    r = None if gated else torch.randn(tokens, 40, device=DEV).bfloat16()
    many = blocks_x16.gemv_x16(x, qw, norm_weight=nw, eps=1e-5, residual=r, gated=gated)
    for i in range(tokens):
        one = blocks_x16.gemv_x16(x[i:i + 1], qw, norm_weight=nw, eps=1e-5, gated=gated,
                                  residual=None if r is None else r[i:i + 1])
        assert torch.equal(many[i:i + 1], one), i
    plain = blocks_matmul(x, qw)
    _check(plain, x, qw)
