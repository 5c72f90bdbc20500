"""The launch shared by the few-token products on a GGUF's blocks (blocks.py's dot kernel,
blocks_tc.py's tensor-core kernel): a grid of row tiles x token tiles x parts of each row's
blocks, and the launch that adds the parts.

A layer with few output tiles would leave most SMs idle, so each row's blocks split into
up to 8 parts (grid axis 2; `split_for`), each program writing its fp32 sums to part[p];
`_sum_splits` then adds the parts in order and finishes the rows as an unsplit program
finishes them (int4.py `store_tokens`: rounded to x's dtype, the residual added). With one
part the product's programs finish the rows themselves.

The products' kernels take the same leading arguments, in this order: x, the blocks, their
scales and offsets, out, the residual (out when none), part, T, N, K, GPS (blocks a part),
then the strides of x, the blocks, scales, offsets, out and the residual; and the
constexprs RES, SPLIT, BLOCK_N, BLOCK_T and USE_PDL.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl_flags
from specserve.kernels.int4 import store_tokens
from specserve.kernels.pdl import wait_and_release

PROGRAMS = 512  # programs a few-token product aims for: several an SM, so narrow layers keep memory busy


def split_for(tiles: int, steps: int, programs: int | None = None) -> int:
    """Into how many parts a few-token product splits each row's blocks: enough that
    `tiles` output tiles make `programs` (PROGRAMS unless given) programs, a power of two,
    at most 8 and never more parts than the row has tiles of blocks (`steps`)."""
    aim = PROGRAMS if programs is None else programs
    split = 1
    while tiles * split < aim and split * 2 <= min(8, steps):
        split *= 2
    return split


@triton.jit
def program_tile(T, N, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """(rows, their mask, tokens, their mask) of program (n, t, p)'s output tile."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    return rows, rows < N, toks, toks < T


@triton.jit
def finish(acc, part_ptr, out_ptr, res_ptr, rows, rmask, toks, tmask, T, N, sout, sr, DTYPE: tl.constexpr,
           RES: tl.constexpr, SPLIT: tl.constexpr):
    """A product program's end: its fp32 sums `acc` [BLOCK_N, BLOCK_T] to part[p] when the
    rows are split (`_sum_splits` finishes them), else the finished rows (`store_tokens`)."""
    if SPLIT > 1:
        at = part_ptr + (tl.program_id(2) * T + toks[None, :]).to(tl.int64) * N + rows[:, None]
        tl.store(at, acc, mask=rmask[:, None] & tmask[None, :])
    else:
        store_tokens(acc, out_ptr, res_ptr, rows, rmask, toks, tmask, sout, sr, DTYPE, RES)


@triton.jit
def _sum_splits(part_ptr, out_ptr, res_ptr, x_ptr, T, N, sout, sr, SPLIT: tl.constexpr, RES: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, USE_PDL: tl.constexpr):
    """out = the SPLIT partial sums of a split product, added in order, then finished as
    its unsplit programs finish them (`store_tokens`)."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    wait_and_release(USE_PDL)
    rows, rmask, toks, tmask = program_tile(T, N, BLOCK_N, BLOCK_T)
    m = rmask[:, None] & tmask[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for p in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + (p * T + toks[None, :]).to(tl.int64) * N + rows[:, None], mask=m, other=0.0)
    store_tokens(acc, out_ptr, res_ptr, rows, rmask, toks, tmask, sout, sr, DTYPE, RES)


def launch(kernel: triton.JITFunction, x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
           offset: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None, blocks: int,
           tile: tuple[int, int, int], num_warps: int, programs: int | None = None, **meta: object) -> torch.Tensor:
    """out = `kernel`'s product of x [T, K] and the `blocks` blocks a row of `data` [N, ...],
    in tiles of (BLOCK_N rows, BLOCK_T tokens, blocks a K step), split for `programs`
    (`split_for`); `meta`: the kernel's own constexprs and launch options."""
    t, n = x.shape[0], out.shape[1]
    block_n, block_t, step = tile
    tiles = triton.cdiv(n, block_n) * triton.cdiv(t, block_t)
    steps = triton.cdiv(blocks, step)
    split = split_for(tiles, steps, programs)
    gps = triton.cdiv(steps, split) * step  # blocks a part
    part = torch.empty(split, t, n, dtype=torch.float32, device=x.device) if split > 1 else out
    res = residual if residual is not None else out
    sr = residual.stride(0) if residual is not None else 0
    flags = pdl_flags(x.device)
    kernel[(triton.cdiv(n, block_n), triton.cdiv(t, block_t), split)](
        x, data, scale, offset, out, res, part, t, n, x.shape[1], gps,
        x.stride(0), data.stride(0), scale.stride(0), offset.stride(0), out.stride(0), sr,
        RES=residual is not None, SPLIT=split, BLOCK_N=block_n, BLOCK_T=block_t, num_warps=num_warps,
        **meta, **flags)
    if split > 1:
        _sum_splits[(triton.cdiv(n, 128), triton.cdiv(t, block_t))](
            part, out, res, x, t, n, out.stride(0), sr, SPLIT=split, RES=residual is not None,
            BLOCK_N=128, BLOCK_T=block_t, num_warps=4, **flags)
    return out
