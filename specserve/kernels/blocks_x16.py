"""One-token q4 layers by 16-bit integer dot products: y = W x, x rounded to int16 a block.

blocks.py's one-token kernel multiplies each nibble in fp32: a shift, a logic op and a
multiply-add a weight, and tiles of 16 to 32 rows to spread x's loads over them. On a GPU
that kernel is bound by its instructions and streams q4 at about a third of the copy rate.
Here, for half-precision x (bf16, fp16), two launches do the layer:
- `_quantize_kernel` rounds x (or its RMSNorm: the pre-norm of qkv and gate_up, fused here)
  to int16 per block of 32 columns (scale = the block's largest |x| / 32767) and stores the
  values as int16 pairs in the order the products take them, with each block's scale and
  its sum of x (fp32, of x as given).
- `_gemv_kernel` reads a q4 word (8 nibbles: byte b holds column 4w + b low and 4w + b + 16
  high, core/quant.py) as two words of bytes, v & 0x0F0F0F0F and (v >> 4) & 0x0F0F0F0F,
  and multiplies them with x's pairs by four `dp2a` (two int16 times two unsigned bytes,
  added to an int32): about one instruction a weight. A program takes 2 or 4 rows and one
  block a lane, so its loads run along whole rows, as the bf16 GEMV's do; gate_up's
  programs take a gate row and its up row and end in SiLU*mul, as matvec.py's do.
Pair (w, j) of block g sits at g * 16 + 4 j + w: j = 0, 1 hold columns 4w + 2j and + 1
(the low nibbles' bytes 0-1 and 2-3), j = 2, 3 the same + 16 (the high nibbles').

Rounding contract: x's values are rounded to multiples of their block's scale (an error of
at most 2^-16 of the block's largest |x|, below half an ulp of bf16 for every value within
2^8 of it); the products and their sums over a block are exact (int32); then, in fp32,
per block scale_x * isum, per weight scale s * that + o * sum(x) as blocks.py does, the
row rounded to x's dtype, the residual added and rounded. On the CPU (TRITON_INTERPRET)
`dp2a` is written out in integer ops with the same result.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.core.quant import Q4, QuantWeight
from specserve.kernels import pdl_flags
from specserve.kernels.matvec import x_chunk
from specserve.kernels.pdl import wait_and_release

INT16_MAX = 32767
QUANT_BLOCKS = 32  # x's blocks a quantizing program takes


def takes(x: torch.Tensor, qw: QuantWeight) -> bool:
    """Whether this path serves x [T, K] times `qw`: one token of half-precision x on q4."""
    return qw.method == Q4 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)


@triton.jit
def _quantize_kernel(x_ptr, nw_ptr, xq_ptr, xs_ptr, xsum_ptr, K, eps, BLOCKS: tl.constexpr, NORM: tl.constexpr,
                     USE_PDL: tl.constexpr):
    """Blocks [BLOCKS * pid, + BLOCKS) of x (with NORM: of rmsnorm(x) * nw, rounded as
    matvec.py's fused norm rounds it, over the whole row's sum of squares): int16 pairs
    (module docstring's order), scales, sums."""
    wait_and_release(USE_PDL)
    NB = K // 32
    b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    bmask = b < NB
    cols = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    rstd = 1.0
    if NORM:  # rsqrt(mean(x^2) + eps) over the whole row, in fp32
        at = tl.arange(0, 1024)
        ss = tl.zeros([1024], dtype=tl.float32)
        for k0 in range(0, K, 1024):
            v = tl.load(x_ptr + k0 + at, mask=k0 + at < K, other=0.0).to(tl.float32)
            ss += v * v
        rstd = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    x = x_chunk(x_ptr, nw_ptr, cols, bmask[:, None] & (cols < K), rstd, NORM, True, False)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, amax / 32767.0, 1.0)
    v = x / scale[:, None]
    q = tl.where(v < 0, v - 0.5, v + 0.5).to(tl.int32)  # to nearest, ties away from zero
    lo, hi = tl.split(tl.reshape(q, [BLOCKS, 2, 4, 2, 2]))  # [block, half, w, jj], columns 16 half + 4 w + 2 jj
    pair = tl.reshape(tl.permute((lo & 0xFFFF) | (hi << 16), (0, 1, 3, 2)), [BLOCKS, 16])  # at 4 (2 half + jj) + w
    tl.store(xq_ptr + b[:, None] * 16 + tl.arange(0, 16)[None, :], pair, mask=bmask[:, None])
    tl.store(xs_ptr + b, scale, mask=bmask)
    tl.store(xsum_ptr + b, tl.sum(x, axis=1), mask=bmask)


@triton.jit
def _dp2a(a, b, c, HI: tl.constexpr, ASM: tl.constexpr):
    """c + a's low int16 * b's byte 0 (HI: 2) + a's high int16 * byte 1 (HI: 3), bytes unsigned."""
    if ASM:
        if HI:
            return tl.inline_asm_elementwise("dp2a.hi.s32.u32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise("dp2a.lo.s32.u32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    if HI:
        b = b >> 16
    return c + ((a << 16) >> 16) * (b & 0xFF) + (a >> 16) * ((b >> 8) & 0xFF)


@triton.jit
def _tile(w_rows, s_ptr, o_ptr, rows, rmask, g, gmask, gs, gsmask, ss, so, OFFSET: tl.constexpr):
    """The words of groups g of rows [BLOCK_N, GROUPS, 4] and the scales and offsets gs of
    those groups [BLOCK_N, GROUPS / EVERY] in fp32 (offsets 0 without OFFSET)."""
    words = tl.load(w_rows + g[None, :, None] * 4 + tl.arange(0, 4)[None, None, :],
                    mask=rmask[:, None, None] & gmask[None, :, None], other=0)
    sm = rmask[:, None] & gsmask[None, :]
    s = tl.load(s_ptr + rows[:, None] * ss + gs[None, :], mask=sm, other=0.0).to(tl.float32)
    o = tl.zeros_like(s)
    if OFFSET:
        o = tl.load(o_ptr + rows[:, None] * so + gs[None, :], mask=sm, other=0.0).to(tl.float32)
    return words, s, o


@triton.jit
def _row_sums(xq_ptr, xs_ptr, xsum_ptr, w_ptr, s_ptr, o_ptr, rows, rmask, NG, sw, ss, so, EVERY: tl.constexpr,
              OFFSET: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, ASM: tl.constexpr,
              USE_PDL: tl.constexpr):
    """fp32 sums [BLOCK_N] of rows of W times x: per word four dp2a into int32, per block
    its scale, per scale group s * sum + o * sum(x). The next tile's loads are issued
    before this one's arithmetic, the first before the PDL wait (USE_PDL)."""
    SG: tl.constexpr = GROUPS // EVERY  # scales a tile
    gi = tl.arange(0, GROUPS)
    si = tl.arange(0, SG)
    wi = tl.arange(0, 4)
    w_rows = w_ptr + rows[:, None, None].to(tl.int64) * sw
    NS = (NG + EVERY - 1) // EVERY  # scales a row (the last may cover fewer blocks)
    words, s, o = _tile(w_rows, s_ptr, o_ptr, rows, rmask, gi, gi < NG, si, si < NS, ss, so, OFFSET)
    wait_and_release(USE_PDL)  # past this, x's pairs (and the residual) are visible
    acc = tl.zeros([BLOCK_N, SG], dtype=tl.float32)
    for g0 in range(0, NG, GROUPS):
        g = g0 + gi
        gmask = g < NG
        gs = g0 // EVERY + SG + si
        words_n, s_n, o_n = _tile(w_rows, s_ptr, o_ptr, rows, rmask, g + GROUPS, g + GROUPS < NG, gs, gs < NS,
                                  ss, so, OFFSET)
        at = xq_ptr + (g * 16)[None, :, None] + wi[None, None, :]
        xm = gmask[None, :, None]
        lo = words & 0x0F0F0F0F
        hi = (words >> 4) & 0x0F0F0F0F
        isum = _dp2a(tl.load(at, mask=xm, other=0), lo, tl.zeros_like(words), False, ASM)
        isum = _dp2a(tl.load(at + 4, mask=xm, other=0), lo, isum, True, ASM)
        isum = _dp2a(tl.load(at + 8, mask=xm, other=0), hi, isum, False, ASM)
        isum = _dp2a(tl.load(at + 12, mask=xm, other=0), hi, isum, True, ASM)
        xq = tl.sum(isum, axis=2).to(tl.float32) * tl.load(xs_ptr + g, mask=gmask, other=0.0)[None, :]
        x_sum = tl.load(xsum_ptr + g, mask=gmask, other=0.0)[None, :]
        if EVERY > 1:  # the blocks that share a scale
            xq = tl.sum(tl.reshape(xq, [BLOCK_N, SG, EVERY]), axis=2)
            x_sum = tl.sum(tl.reshape(x_sum, [1, SG, EVERY]), axis=2)
        acc += s * xq + o * x_sum
        words, s, o = words_n, s_n, o_n
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv_kernel(xq_ptr, xs_ptr, xsum_ptr, w_ptr, s_ptr, o_ptr, out_ptr, res_ptr, N, NG, sw, ss, so,
                 EVERY: tl.constexpr, OFFSET: tl.constexpr, RES: tl.constexpr, GATED: tl.constexpr,
                 BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr):
    """BLOCK_N rows a program (`_row_sums`), rounded to x's dtype as F.linear's output is;
    GATED (W = [Wg; Wu], 2N rows): BLOCK_N / 2 gate rows r and their up rows N + r in one
    tile, then SiLU and the product as activation.py rounds them; RES: plus the residual,
    rounded."""
    DTYPE: tl.constexpr = res_ptr.dtype.element_ty
    if GATED:
        HALF: tl.constexpr = BLOCK_N // 2
        i = tl.arange(0, BLOCK_N)
        first = tl.program_id(0) * HALF
        rows = tl.where(i < HALF, first + i, N + first + i - HALF)  # gate rows, then their up rows
        rmask = (first + i % HALF) < N
        y = _row_sums(xq_ptr, xs_ptr, xsum_ptr, w_ptr, s_ptr, o_ptr, rows, rmask, NG, sw, ss, so, EVERY, OFFSET,
                      BLOCK_N, GROUPS, ASM, USE_PDL).to(DTYPE).to(tl.float32)
        gate, up = tl.split(tl.permute(tl.reshape(y, [2, HALF]), (1, 0)))
        y = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32) * up
        rows = first + tl.arange(0, HALF)
        rmask = rows < N
    else:
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        y = _row_sums(xq_ptr, xs_ptr, xsum_ptr, w_ptr, s_ptr, o_ptr, rows, rmask, NG, sw, ss, so, EVERY, OFFSET,
                      BLOCK_N, GROUPS, ASM, USE_PDL).to(DTYPE).to(tl.float32)
    if RES:
        y = (tl.load(res_ptr + rows, mask=rmask, other=0.0).to(tl.float32) + y).to(DTYPE).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rmask)


Config = tuple[int, int]  # (BLOCK_N, GROUPS); one warp


def config(n: int, every: int) -> Config:
    """2 rows a program for weights of 16384 rows or more (gate_up's [Wg; Wu]: a gate row
    and its up row; the LM head), else 4; one block a lane of a single warp. From a sweep
    of the Llama-8B layers on an H200 (docs/benchmarks.md)."""
    return (2 if n >= 16384 else 4), max(32, every)


def quantize(x: torch.Tensor, norm_weight: torch.Tensor | None = None,
             eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int16 pairs int32 [K / 2], scales [K / 32], sums [K / 32]) of x [1, K] (contiguous,
    K a multiple of 32), or of its RMSNorm by `norm_weight` [K] when given."""
    k = x.shape[1]
    nb = k // 32
    xq = torch.empty(k // 2, dtype=torch.int32, device=x.device)
    xs = torch.empty(nb, dtype=torch.float32, device=x.device)
    xsum = torch.empty(nb, dtype=torch.float32, device=x.device)
    _quantize_kernel[(triton.cdiv(nb, QUANT_BLOCKS),)](
        x, norm_weight if norm_weight is not None else x, xq, xs, xsum, k, eps, BLOCKS=QUANT_BLOCKS,
        NORM=norm_weight is not None, num_warps=4, **pdl_flags(x.device))
    return xq, xs, xsum


def gemv_x16(x: torch.Tensor, qw: QuantWeight, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
             residual: torch.Tensor | None = None, gated: bool = False, out_dtype: torch.dtype | None = None,
             launch: Config | None = None) -> torch.Tensor:
    """x [1, K] (half; `takes`) times the q4 weight [N, K] -> [1, N]; with `norm_weight` of
    x's RMSNorm (one launch with the rounding to int16), plus `residual` [1, N], or with
    `gated` silu(Wg x) * (Wu x) of W = [Wg; Wu] -> [1, N / 2]; each rounded as its torch op
    (blocks.py's `_packed_gemv` order). `launch`: (BLOCK_N, GROUPS) instead of `config`'s."""
    rows, k = qw.shape
    n = rows // 2 if gated else rows
    every = qw.group // 32
    block_n, groups = launch or config(rows, every)
    assert groups % every == 0 and k % 32 == 0 and (block_n % 2 == 0 or not gated), (groups, every, k, block_n)
    x = x.reshape(1, k).contiguous()
    out = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    if residual is not None:
        assert residual.numel() == n and residual.dtype == x.dtype, (residual.shape, residual.dtype)
        residual = residual.reshape(1, n).contiguous()
    xq, xs, xsum = quantize(x, norm_weight, eps)
    data = qw.data if qw.data.stride(1) == 1 else qw.data.contiguous()
    words = data.view(torch.int32)
    scale = qw.scale if qw.scale.stride(1) == 1 else qw.scale.contiguous()
    offset = qw.zeros if qw.zeros is not None else scale
    _gemv_kernel[(triton.cdiv(n, block_n // 2 if gated else block_n),)](
        xq, xs, xsum, words, scale, offset, out, residual if residual is not None else x, n, k // 32,
        words.stride(0), scale.stride(0), offset.stride(0),
        EVERY=every, OFFSET=qw.zeros is not None, RES=residual is not None, GATED=gated, BLOCK_N=block_n,
        GROUPS=groups, ASM=x.is_cuda, num_warps=1, **pdl_flags(x.device))
    return out
