"""The batch-invariant linear layer of `--enable-deterministic-inference`: y = x W^T (+ b).

Invariant: row i of a call over M rows equals, bit for bit, the call over that row alone,
for every M. A row's arithmetic is fixed by the weight's shape and the dtypes only:
  * tiles of BLOCK_M = 16 rows for every M (a decode step pads its one row to 16): M
    only sets how many row tiles there are and how many one program takes (`row_tiles`),
    never a tile's shape or its arithmetic;
  * BLOCK_N and BLOCK_K come from (N, K) alone (`config`), and K is never split over
    programs: one program sums all of a row's K columns, BLOCK_K at a time, in order,
    into one fp32 accumulator through tl.dot;
  * M is not specialised on (`do_not_specialize`), so one compiled kernel serves all M.
cuBLAS chooses its kernel (tile, split-K, stream-K) from M, which is why a verify of N
tokens and a decode of one round the same row differently there.

The few-token GEMVs (`matvec.py`, `skinny.py`) pick their tiles and splits from the token
count too, so the mode does not use them: each linear layer runs here, with two of the
few-token path's fused forms (models/invariant.py `forward_layers`): gate_up's SiLU*mul
(a program takes a gate tile and the up tile of the same columns) and the residual add.
The pre-norms stay separate launches: any use of the x tile besides the product (even
its sum of squares alone) slowed this kernel by more than the norm's launch costs.
Above TILED_ROWS rows a program takes several row tiles against its weight tile
(`row_tiles`): a schedule, not an arithmetic, choice.
Epilogues run in fp32 and round once. float32 models get IEEE fp32 products (no TF32).
Weights are [N, K], any strides (unit column stride on GPUs, where a stride of 1
compiles as a constant; the CPU's transposed layout under the interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl_flags
from specserve.kernels.pdl import wait_and_release

BLOCK_M = 16


@triton.jit
def _tile_step(x_ptr, rows, ks, kmask, sx, M, w, w_up, acc, acc_up, GATED: tl.constexpr, PREC: tl.constexpr):
    """One BLOCK_K step of one row tile: its x tile times the weight tile(s) [BLOCK_K, BLOCK_N]."""
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sx + ks[None, :], mask=(rows < M)[:, None] & kmask[None, :],
                other=0.0)
    acc = tl.dot(x, w, acc, input_precision=PREC)
    if GATED:
        acc_up = tl.dot(x, w_up, acc_up, input_precision=PREC)
    return acc, acc_up


@triton.jit
def _tile_store(y_ptr, b_ptr, r_ptr, rows, cols, M, N, sr, sy, acc, acc_up, HAS_BIAS: tl.constexpr,
                RES: tl.constexpr, GATED: tl.constexpr):
    """A row tile's epilogue (bias, silu(gate) * up, residual, in fp32), rounded once."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    omask = (rows < M)[:, None] & (cols < N)[None, :]
    if RES:
        acc += tl.load(r_ptr + rows[:, None].to(tl.int64) * sr + cols[None, :], mask=omask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * sy + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=omask)


@triton.jit(do_not_specialize=["M"])
def _invariant_mm_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, M, N, K, sx, sw, swk, sr, sy, HAS_BIAS: tl.constexpr,
                         RES: tl.constexpr, GATED: tl.constexpr, PREC: tl.constexpr, TILES: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """Row tiles TILES * pid0 .. + TILES - 1 (TILES 1, 2 or 4) against one column tile: each
    row tile its own accumulator and its own dots, as a program of one tile computes it."""
    rows = tl.program_id(0) * (TILES * BLOCK_M) + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = cols < N
    a0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a1, a2, a3, u0, u1, u2, u3 = a0, a0, a0, a0, a0, a0, a0  # u*: GATED's up columns
    wait_and_release(USE_PDL)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        w_offs = cols[:, None].to(tl.int64) * sw + ks[None, :] * swk
        wmask = nmask[:, None] & kmask[None, :]
        w = tl.trans(tl.load(w_ptr + w_offs, mask=wmask, other=0.0))
        w_up = w
        if GATED:  # the up tile of the same columns, N rows further down
            w_up = tl.trans(tl.load(w_ptr + N * sw + w_offs, mask=wmask, other=0.0))
        a0, u0 = _tile_step(x_ptr, rows, ks, kmask, sx, M, w, w_up, a0, u0, GATED, PREC)
        if TILES >= 2:
            a1, u1 = _tile_step(x_ptr, rows + BLOCK_M, ks, kmask, sx, M, w, w_up, a1, u1, GATED, PREC)
        if TILES >= 4:
            a2, u2 = _tile_step(x_ptr, rows + 2 * BLOCK_M, ks, kmask, sx, M, w, w_up, a2, u2, GATED, PREC)
            a3, u3 = _tile_step(x_ptr, rows + 3 * BLOCK_M, ks, kmask, sx, M, w, w_up, a3, u3, GATED, PREC)
    _tile_store(y_ptr, b_ptr, r_ptr, rows, cols, M, N, sr, sy, a0, u0, HAS_BIAS, RES, GATED)
    if TILES >= 2:
        _tile_store(y_ptr, b_ptr, r_ptr, rows + BLOCK_M, cols, M, N, sr, sy, a1, u1, HAS_BIAS, RES, GATED)
    if TILES >= 4:
        _tile_store(y_ptr, b_ptr, r_ptr, rows + 2 * BLOCK_M, cols, M, N, sr, sy, a2, u2, HAS_BIAS, RES, GATED)
        _tile_store(y_ptr, b_ptr, r_ptr, rows + 3 * BLOCK_M, cols, M, N, sr, sy, a3, u3, HAS_BIAS, RES, GATED)


def config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of a weight [n, k]: a function of the
    weight alone, chosen by a sweep at one row (docs/benchmarks.md): wide outputs (an
    lm_head) take 64-row weight tiles, the rest 32 so that narrow layers still spread
    over enough programs; longer rows take longer K tiles."""
    block_k = 128 if k < 1024 else 256 if k <= 4096 else 512
    return (64 if n >= 16384 else 32), min(block_k, max(16, triton.next_power_of_2(k))), 4, (4 if block_k <= 256 else 3)


def row_tiles(m: int) -> int:
    """Row tiles per program: the schedule alone (each tile's arithmetic is a one-tile
    program's), so it may follow M. Many rows share each weight tile four ways, which
    cuts the reads of the weight; few rows keep a program per tile, for parallelism."""
    return 4 if m >= TILED_ROWS else 1


TILED_ROWS = 1024  # from this many rows a program takes four row tiles


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None, *, residual: torch.Tensor | None = None,
                     gated: bool = False) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in `out_dtype` (default x's), each
    row computed as the module docstring fixes it, whatever M is. Fused forms (the module
    docstring's): `residual` [M, N] (added last), `gated` (weight [2N, K] = [gate; up] ->
    silu(gate) * up [M, N])."""
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
    block_n, block_k, warps, stages = config(weight.shape[0], k)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    tiles = row_tiles(m)
    # row tiles vary fastest: the programs that read one weight tile run together, so at
    # many rows the weight streams from memory about once (the rest hit L2)
    grid = (triton.cdiv(m, BLOCK_M * tiles), triton.cdiv(n, block_n))
    _invariant_mm_kernel[grid](
        x, weight, bias if bias is not None else weight, residual if residual is not None else y, y, m, n, k,
        x.stride(0), weight.stride(0), weight.stride(1), residual.stride(0) if residual is not None else 0,
        y.stride(0), HAS_BIAS=bias is not None, RES=residual is not None, GATED=gated, PREC=prec, TILES=tiles,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        **pdl_flags(x.device))
    return y
