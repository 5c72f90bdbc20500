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
count too, so the mode does not use them: each linear layer runs here, with its norm,
SiLU*mul and residual add as separate row-local launches. float32 models get IEEE fp32
products (no TF32). Weights are [N, K], any strides (unit column stride on GPUs, where a
stride of 1 compiles as a constant; the CPU's transposed layout under the interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl_flags
from specserve.kernels.pdl import wait_and_release

BLOCK_M = 16


@triton.jit(do_not_specialize=["M"])
def _invariant_mm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sx, sw, swk, sy, HAS_BIAS: tl.constexpr,
                         PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         USE_PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, nmask = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    wait_and_release(USE_PDL)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sx + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * sw + ks[None, :] * swk, mask=nmask[:, None] & kmask[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows[:, None].to(tl.int64) * sy + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


def config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of a weight [n, k]: a function of the
    weight alone, chosen by a sweep at one row (docs/benchmarks.md): wide outputs (an
    lm_head) take 64-row weight tiles, the rest 32 so that narrow layers still spread
    over enough programs; longer rows take longer K tiles."""
    block_k = 128 if k < 1024 else 256 if k <= 4096 else 512
    return (64 if n >= 16384 else 32), min(block_k, max(16, triton.next_power_of_2(k))), 4, (4 if block_k <= 256 else 3)


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in `out_dtype` (default x's),
    each row computed as the module docstring fixes it, whatever M is."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    if x.stride(-1) != 1:
        x = x.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    block_n, block_k, warps, stages = config(n, k)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    # row tiles vary fastest: the programs that read one weight tile run together, so at
    # many rows the weight streams from memory about once (the rest hit L2)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, block_n))
    _invariant_mm_kernel[grid](x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0),
                               weight.stride(0), weight.stride(1), y.stride(0), HAS_BIAS=bias is not None, PREC=prec,
                               BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
                               **pdl_flags(x.device))
    return y
