"""The batch-invariant linear layer of `--enable-deterministic-inference`: y = x W^T (+ b).

Invariant: row i of a call over M rows equals, bit for bit, the call over that row alone,
for every M. A row's arithmetic is fixed by the weight's shape and the dtypes only:
  * tiles of BLOCK_M = 16 rows for every M (a decode step pads its one row to 16): M
    only sets how many row tiles the grid has, never a tile's shape;
  * BLOCK_N and BLOCK_K come from (N, K) alone (`config`), and K is never split over
    programs: one program sums all of a row's K columns, BLOCK_K at a time, in order,
    into one fp32 accumulator through tl.dot;
  * M is not specialised on (`do_not_specialize`), so one compiled kernel serves all M.
cuBLAS chooses its kernel (tile, split-K, stream-K) from M, which is why a verify of N
tokens and a decode of one round the same row differently there.

The few-token GEMVs (`matvec.py`, `skinny.py`) pick their tiles and splits from the token
count too, so the mode does not use them: each linear layer runs here, with their fused
forms (the pre-norm: each row's own sum of squares, then each x tile normalised as
norm.py rounds it; gate_up's SiLU*mul; the residual add), so a decoder layer is the same
few launches at any token count. float32 models get IEEE fp32 products (no TF32).
Weights are [N, K], any strides (unit column stride on GPUs; the CPU's transposed layout
under the interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl_flags
from specserve.kernels.pdl import wait_and_release

BLOCK_M = 16
_HALF = (torch.float16, torch.bfloat16)


@triton.jit
def _row_rstd(x_ptr, rows, rmask, sx, K, eps, NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """rsqrt(mean(x^2) + eps) of each row (ones without NORM): a row's own sum, K tile by K tile."""
    rstd = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
    if NORM:
        ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sx + ks[None, :],
                        mask=rmask[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
            ss += tl.sum(x * x, axis=1)
        rstd = tl.rsqrt(ss / K + eps)
    return rstd


@triton.jit
def _normed(x, nw_ptr, ks, kmask, rstd, NORM: tl.constexpr, HALF: tl.constexpr):
    """The x tile as RMSNorm leaves it (norm.py's rounding: normalise, round, scale, round)."""
    if NORM:
        g = tl.load(nw_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
        xf = x.to(tl.float32) * rstd[:, None]
        if HALF:
            x = (g[None, :] * xf.to(x.dtype).to(tl.float32)).to(x.dtype)
        else:
            x = xf * g[None, :]
    return x


@triton.jit(do_not_specialize=["M"])
def _invariant_mm_kernel(x_ptr, w_ptr, b_ptr, nw_ptr, r_ptr, y_ptr, M, N, K, sx, sw, swk, sr, sy, eps,
                         HAS_BIAS: tl.constexpr, NORM: tl.constexpr, RES: tl.constexpr, GATED: tl.constexpr,
                         HALF: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, nmask = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # GATED: the up half's columns
    wait_and_release(USE_PDL)
    rstd = _row_rstd(x_ptr, rows, rmask, sx, K, eps, NORM, BLOCK_M, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sx + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0)
        x = _normed(x, nw_ptr, ks, kmask, rstd, NORM, HALF)
        w_offs = cols[:, None].to(tl.int64) * sw + ks[None, :] * swk
        wmask = nmask[:, None] & kmask[None, :]
        acc = tl.dot(x, tl.trans(tl.load(w_ptr + w_offs, mask=wmask, other=0.0)), acc, input_precision=PREC)
        if GATED:
            up = tl.load(w_ptr + N * sw + w_offs, mask=wmask, other=0.0)
            acc_up = tl.dot(x, tl.trans(up), acc_up, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
    dtype = x_ptr.dtype.element_ty
    if GATED:  # silu(gate) * up, each rounded as its torch op (activation.py)
        gate = acc.to(dtype).to(tl.float32)
        acc = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * acc_up.to(dtype).to(tl.float32)
    if RES:  # the product rounded, then the residual added and rounded, as torch's `r + y`
        acc = acc.to(dtype).to(tl.float32) + tl.load(r_ptr + rows[:, None].to(tl.int64) * sr + cols[None, :],
                                                     mask=rmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)
    out = y_ptr + rows[:, None].to(tl.int64) * sy + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


def config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of a weight [n, k]: a function of the
    weight alone, chosen on an H200 at one row (docs/benchmarks.md): wide outputs (an
    lm_head) take 64-row weight tiles, the rest 32 so that narrow layers still spread
    over enough programs; longer rows take longer K tiles."""
    block_k = 128 if k < 1024 else 256 if k <= 4096 else 512
    return (64 if n >= 16384 else 32), min(block_k, max(16, triton.next_power_of_2(k))), 4, (4 if block_k <= 256 else 3)


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None, *, norm_weight: torch.Tensor | None = None,
                     eps: float = 0.0, residual: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in `out_dtype` (default x's), each
    row computed as the module docstring fixes it, whatever M is. The fused forms of
    `matvec.py`: `norm_weight` (x RMS-normalised first), `residual` [M, N] (added after),
    `gated` (weight [2N, K] = [gate; up] -> silu(gate) * up [M, N])."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    if x.stride(-1) != 1:
        x = x.contiguous()
    (m, k), n = x.shape, weight.shape[0] // (2 if gated else 1)
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    if residual is not None:
        residual = residual.reshape(m, n)
        assert residual.stride(-1) == 1, "the residual's columns must be contiguous"
    block_n, block_k, warps, stages = config(n, k)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    # row tiles vary fastest: the programs that read one weight tile run together, so at
    # many rows the weight streams from memory about once (the rest hit L2)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, block_n))
    _invariant_mm_kernel[grid](
        x, weight, bias if bias is not None else weight, norm_weight if norm_weight is not None else weight,
        residual if residual is not None else y, y, m, n, k, x.stride(0), weight.stride(0), weight.stride(1),
        residual.stride(0) if residual is not None else 0, y.stride(0), eps, HAS_BIAS=bias is not None,
        NORM=norm_weight is not None, RES=residual is not None, GATED=gated, HALF=x.dtype in _HALF, PREC=prec,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        **pdl_flags(x.device))
    return y
