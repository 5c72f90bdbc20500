"""q4 and q8 layers at 1-4 tokens by 16-bit integer dot products: y = W x, x rounded to int16.

blocks.py's one-token kernel multiplies each nibble in fp32: a shift, a logic op and a
multiply-add a weight, and tiles of 16 to 32 rows to spread x's loads over them. On a GPU
it streams q4 at about a third of the copy rate: those tiles read short pieces of many
rows, and smaller ones leave its arithmetic the bound.
Here, for up to MAX_TOKENS rows of half-precision x (bf16, fp16), two launches do the layer:
- `_quantize_kernel` rounds each row of x (or its RMSNorm: the pre-norm of qkv and gate_up,
  fused here) to int16 per block of 32 columns (scale = the block's largest |x| / 32767)
  and stores the values as int16 pairs in the order the products take them, with each
  block's scale and its sum of x (fp32, of x as given).
- `_gemv_kernel` multiplies the weight's int32 words with each token's pairs by `dp2a`
  (two int16 times two bytes, added to an int32): about one instruction a weight and
  token. A q4 word (8 nibbles: byte b holds column 4w + b low and 4w + b + 16 high,
  core/quant.py) is read as two words of bytes, v & 0x0F0F0F0F and (v >> 4) & 0x0F0F0F0F,
  four dp2a; a q8 word (four signed bytes, columns 4w to 4w + 3), two. A program takes 2
  or 4 rows and one block a lane, so its loads run along whole rows, as the bf16 GEMV's
  do, and up to four tokens; gate_up's programs take a gate row and its up row and end in
  SiLU*mul, as matvec.py's do. Each token's sums take the same operations in the same
  order whatever the tokens beside it, so a verify's rows equal one-token decoding's bit
  for bit. Past MAX_TOKENS the per-token work outweighs the shared weight reads and
  blocks.py's dot kernel is faster; blocks_tc.py's tensor cores are faster from 3 tokens
  on q4 and from 4 on q8 (`takes` leaves those to it). --enable-deterministic-inference runs this product at
  every row count for that row invariance (`serves`; kernels.invariant_blocks).
Pairs of block g, q4's order: pair (w, j) at g * 16 + 4 j + w, j = 0, 1 holding columns
4w + 2j and + 1 (the low nibbles' bytes 0-1 and 2-3), j = 2, 3 the same + 16 (the high
nibbles'). q8's: pair (w, j) at g * 16 + 8 j + w, columns 4w + 2j and + 1. q8's scales
cover 16 or 32 columns, q4's one or more blocks.

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

from specserve.core.quant import Q4, Q8, QuantWeight
from specserve.kernels import blocks_tc, pdl_flags
from specserve.kernels.matvec import x_chunk
from specserve.kernels.pdl import wait_and_release

INT16_MAX = 32767
QUANT_BLOCKS = 32  # x's blocks a quantizing program takes
MAX_TOKENS = 4  # rows of x this path takes; blocks.py's dot kernel takes more (docs/benchmarks.md)


def serves(qw: QuantWeight, dtype: torch.dtype) -> bool:
    """Whether `gemv_x16` multiplies `qw` with x of `dtype`, at any row count: half x, K a
    multiple of 32, q4, or q8 but for offsets on 16-column groups (no format makes them)."""
    form = qw.method == Q4 or (qw.method == Q8 and (qw.group == 32 or (qw.group == 16 and qw.zeros is None)))
    return form and qw.shape[1] % 32 == 0 and dtype in (torch.bfloat16, torch.float16)


def takes(x: torch.Tensor, qw: QuantWeight) -> bool:
    """Whether this path is the fastest for x [T, K] times `qw` (`serves`): up to MAX_TOKENS
    rows, but not what blocks_tc.py's tensor cores take (q4 from 3 tokens, q8 from 4: faster there)."""
    return serves(qw, x.dtype) and 1 <= x.shape[0] <= MAX_TOKENS and not blocks_tc.takes(x, qw)


@triton.jit
def _quantize_kernel(x_ptr, nw_ptr, xq_ptr, xs_ptr, xsum_ptr, K, sx, eps, BLOCKS: tl.constexpr, NORM: tl.constexpr,
                     Q8: tl.constexpr, USE_PDL: tl.constexpr):
    """Blocks [BLOCKS * pid, + BLOCKS) of row program_id(1) of x (with NORM: of rmsnorm(x) *
    nw, rounded as matvec.py's fused norm rounds it, over the whole row's sum of squares):
    int16 pairs in the order q4's (or Q8: q8's) products take them, scales, sums."""
    wait_and_release(USE_PDL)
    NB = K // 32
    t = tl.program_id(1)
    x_ptr += t.to(tl.int64) * sx
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
    if Q8:
        lo, hi = tl.split(tl.reshape(q, [BLOCKS, 8, 2, 2]))  # [block, w, j], columns 4 w + 2 j
        pair = tl.reshape(tl.permute((lo & 0xFFFF) | (hi << 16), (0, 2, 1)), [BLOCKS, 16])  # at 8 j + w
    else:
        lo, hi = tl.split(tl.reshape(q, [BLOCKS, 2, 4, 2, 2]))  # [block, half, w, jj], columns 16 half + 4 w + 2 jj
        pair = tl.reshape(tl.permute((lo & 0xFFFF) | (hi << 16), (0, 1, 3, 2)), [BLOCKS, 16])  # at 4 (2 half + jj) + w
    tl.store(xq_ptr + t * (NB * 16) + b[:, None] * 16 + tl.arange(0, 16)[None, :], pair, mask=bmask[:, None])
    tl.store(xs_ptr + t * NB + b, scale, mask=bmask)
    tl.store(xsum_ptr + t * NB + b, tl.sum(x, axis=1), mask=bmask)


@triton.jit
def _dp2a(a, b, c, HI: tl.constexpr, SIGNED: tl.constexpr, ASM: tl.constexpr):
    """c + a's low int16 * b's byte 0 (HI: 2) + a's high int16 * byte 1 (HI: 3), the bytes
    unsigned (q4's nibbles) or SIGNED (q8's values)."""
    if ASM:
        if SIGNED:
            if HI:
                return tl.inline_asm_elementwise("dp2a.hi.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                                 dtype=tl.int32, is_pure=True, pack=1)
            return tl.inline_asm_elementwise("dp2a.lo.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        if HI:
            return tl.inline_asm_elementwise("dp2a.hi.s32.u32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise("dp2a.lo.s32.u32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    if HI:
        b = b >> 16
    if SIGNED:
        return c + ((a << 16) >> 16) * ((b << 24) >> 24) + (a >> 16) * ((b << 16) >> 24)
    return c + ((a << 16) >> 16) * (b & 0xFF) + (a >> 16) * ((b >> 8) & 0xFF)


@triton.jit
def block_tile(w_rows, s_ptr, o_ptr, rows, rmask, g, gmask, gs, gsmask, ss, so, WPB: tl.constexpr,
          OFFSET: tl.constexpr):
    """The int32 words of blocks g of rows [BLOCK_N, GROUPS, WPB] and the scales and offsets
    gs [BLOCK_N, SG] that cover them, in fp32 (offsets 0 without OFFSET); blocks.py's
    one-token kernel reads its tiles with it too."""
    words = tl.load(w_rows + g[None, :, None] * WPB + tl.arange(0, WPB)[None, None, :],
                    mask=rmask[:, None, None] & gmask[None, :, None], other=0)
    sm = rmask[:, None] & gsmask[None, :]
    s = tl.load(s_ptr + rows[:, None] * ss + gs[None, :], mask=sm, other=0.0).to(tl.float32)
    o = tl.zeros_like(s)
    if OFFSET:
        o = tl.load(o_ptr + rows[:, None] * so + gs[None, :], mask=sm, other=0.0).to(tl.float32)
    return words, s, o


@triton.jit
def _token_part(xq_ptr, xs_ptr, xsum_ptr, lo, hi, g, gmask, s, o, EVERY: tl.constexpr, SUB: tl.constexpr,
                Q8: tl.constexpr, OFFSET: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                SG: tl.constexpr, ASM: tl.constexpr):
    """One token's part of a tile [BLOCK_N, SG]: its pairs (at xq_ptr) times the words by
    dp2a into int32 (q4: four a word, `lo` and `hi` its low and high nibbles; Q8: two, `lo`
    the words), per block (or half block: SUB 2) its scale, per scale group s * sum
    (+ o * sum(x) with OFFSET). Masked-off blocks (or tokens) add zeros."""
    xm = gmask[None, :, None]
    if Q8:
        at = xq_ptr + (g * 16)[None, :, None] + tl.arange(0, 8)[None, None, :]
        isum = _dp2a(tl.load(at, mask=xm, other=0), lo, tl.zeros_like(lo), False, True, ASM)
        isum = _dp2a(tl.load(at + 8, mask=xm, other=0), lo, isum, True, True, ASM)
    else:
        at = xq_ptr + (g * 16)[None, :, None] + tl.arange(0, 4)[None, None, :]
        isum = _dp2a(tl.load(at, mask=xm, other=0), lo, tl.zeros_like(lo), False, False, ASM)
        isum = _dp2a(tl.load(at + 4, mask=xm, other=0), lo, isum, True, False, ASM)
        isum = _dp2a(tl.load(at + 8, mask=xm, other=0), hi, isum, False, False, ASM)
        isum = _dp2a(tl.load(at + 12, mask=xm, other=0), hi, isum, True, False, ASM)
    xs = tl.load(xs_ptr + g, mask=gmask, other=0.0)
    if SUB == 2:  # q8 of 16 columns a scale: each half block's sum
        half = tl.sum(tl.reshape(isum, [BLOCK_N, GROUPS, 2, 4]), axis=3).to(tl.float32) * xs[None, :, None]
        xq = tl.reshape(half, [BLOCK_N, SG])
    else:
        xq = tl.sum(isum, axis=2).to(tl.float32) * xs[None, :]
    if EVERY > 1:  # the blocks that share a scale
        xq = tl.sum(tl.reshape(xq, [BLOCK_N, SG, EVERY]), axis=2)
    part = s * xq
    if OFFSET:  # (SUB 1: a scale covers whole blocks)
        x_sum = tl.load(xsum_ptr + g, mask=gmask, other=0.0)[None, :]
        if EVERY > 1:
            x_sum = tl.sum(tl.reshape(x_sum, [1, SG, EVERY]), axis=2)
        part += o * x_sum
    return part


@triton.jit
def _row_sums(xq_ptr, xs_ptr, xsum_ptr, w_ptr, s_ptr, o_ptr, rows, rmask, t0, T, NG, sw, ss, so,
              EVERY: tl.constexpr, SUB: tl.constexpr, Q8: tl.constexpr, OFFSET: tl.constexpr,
              BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, TOKENS: tl.constexpr, ASM: tl.constexpr,
              USE_PDL: tl.constexpr):
    """fp32 sums [BLOCK_N] of rows of W times tokens t0 .. t0 + TOKENS - 1 of x (those
    below T; the others' sums are zeros), four of them: q4's nibbles of a tile are taken
    apart once for every token (`_token_part`), and each token's sums go through the same
    operations in the same order as with TOKENS = 1, so a row's result does not depend on
    the tokens beside it. The next tile's loads are issued before this one's arithmetic,
    the first before the PDL wait (USE_PDL)."""
    SG: tl.constexpr = GROUPS * SUB // EVERY  # scales a tile
    WPB: tl.constexpr = 8 if Q8 else 4  # int32 words a block of 32 columns
    KH = NG * 16  # a token's pairs
    gi = tl.arange(0, GROUPS)
    si = tl.arange(0, SG)
    w_rows = w_ptr + rows[:, None, None].to(tl.int64) * sw
    NS = (NG * SUB + EVERY - 1) // EVERY  # scales a row (q4's last may cover fewer blocks)
    words, s, o = block_tile(w_rows, s_ptr, o_ptr, rows, rmask, gi, gi < NG, si, si < NS, ss, so, WPB, OFFSET)
    wait_and_release(USE_PDL)  # past this, x's pairs (and the residual) are visible
    acc0 = tl.zeros([BLOCK_N, SG], dtype=tl.float32)
    acc1, acc2, acc3 = acc0, acc0, acc0
    for g0 in range(0, NG, GROUPS):
        g = g0 + gi
        gmask = g < NG
        gs = g0 * SUB // EVERY + SG + si
        words_n, s_n, o_n = block_tile(w_rows, s_ptr, o_ptr, rows, rmask, g + GROUPS, g + GROUPS < NG, gs, gs < NS,
                                  ss, so, WPB, OFFSET)
        lo, hi = words, words
        if not Q8:
            lo = words & 0x0F0F0F0F
            hi = (words >> 4) & 0x0F0F0F0F
        acc0 += _token_part(xq_ptr + t0 * KH, xs_ptr + t0 * NG, xsum_ptr + t0 * NG, lo, hi, g, gmask & (g * 0 + t0 < T),
                            s, o, EVERY, SUB, Q8, OFFSET, BLOCK_N, GROUPS, SG, ASM)
        if TOKENS > 1:
            acc1 += _token_part(xq_ptr + (t0 + 1) * KH, xs_ptr + (t0 + 1) * NG, xsum_ptr + (t0 + 1) * NG, lo, hi, g,
                                gmask & (g * 0 + t0 + 1 < T), s, o, EVERY, SUB, Q8, OFFSET, BLOCK_N, GROUPS, SG, ASM)
        if TOKENS > 2:
            acc2 += _token_part(xq_ptr + (t0 + 2) * KH, xs_ptr + (t0 + 2) * NG, xsum_ptr + (t0 + 2) * NG, lo, hi, g,
                                gmask & (g * 0 + t0 + 2 < T), s, o, EVERY, SUB, Q8, OFFSET, BLOCK_N, GROUPS, SG, ASM)
            acc3 += _token_part(xq_ptr + (t0 + 3) * KH, xs_ptr + (t0 + 3) * NG, xsum_ptr + (t0 + 3) * NG, lo, hi, g,
                                gmask & (g * 0 + t0 + 3 < T), s, o, EVERY, SUB, Q8, OFFSET, BLOCK_N, GROUPS, SG, ASM)
        words, s, o = words_n, s_n, o_n
    return tl.sum(acc0, axis=1), tl.sum(acc1, axis=1), tl.sum(acc2, axis=1), tl.sum(acc3, axis=1)


@triton.jit
def _finish(y, t, T, out_ptr, res_ptr, rows, rmask, N, sr, RES: tl.constexpr, GATED: tl.constexpr,
            DTYPE: tl.constexpr, HALF: tl.constexpr):
    """Token t's output row from its sums y: rounded to x's dtype as F.linear's output is;
    GATED (y: HALF gate rows, then their up rows): SiLU and the product as activation.py
    rounds them; RES: plus the residual, rounded."""
    y = y.to(DTYPE).to(tl.float32)
    if GATED:
        gate, up = tl.split(tl.permute(tl.reshape(y, [2, HALF]), (1, 0)))
        y = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32) * up
    m = rmask & (rows * 0 + t < T)
    if RES:
        y = (tl.load(res_ptr + t * sr + rows, mask=m, other=0.0).to(tl.float32) + y).to(DTYPE).to(tl.float32)
    tl.store(out_ptr + t * N + rows, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _gemv_kernel(xq_ptr, xs_ptr, xsum_ptr, w_ptr, s_ptr, o_ptr, out_ptr, res_ptr, T, N, NG, sw, ss, so, sr,
                 EVERY: tl.constexpr, SUB: tl.constexpr, Q8: tl.constexpr, OFFSET: tl.constexpr,
                 RES: tl.constexpr, GATED: tl.constexpr,
                 BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, TOKENS: tl.constexpr, ASM: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """Program (tokens, rows): TOKENS tokens from TOKENS * program_id(0) (the fastest grid
    axis, so the programs reading one row block run together and share its loads in L2)
    and BLOCK_N rows (`_row_sums`); GATED (W = [Wg; Wu], 2N rows): BLOCK_N / 2 gate rows r
    and their up rows N + r in one tile (`_finish`)."""
    DTYPE: tl.constexpr = res_ptr.dtype.element_ty
    HALF: tl.constexpr = BLOCK_N // 2
    t0 = tl.program_id(0) * TOKENS
    i = tl.arange(0, BLOCK_N)
    if GATED:
        first = tl.program_id(1) * HALF
        rows = tl.where(i < HALF, first + i, N + first + i - HALF)  # gate rows, then their up rows
        rmask = (first + i % HALF) < N
    else:
        rows = tl.program_id(1) * BLOCK_N + i
        rmask = rows < N
    y0, y1, y2, y3 = _row_sums(xq_ptr, xs_ptr, xsum_ptr, w_ptr, s_ptr, o_ptr, rows, rmask, t0, T, NG, sw, ss, so,
                               EVERY, SUB, Q8, OFFSET, BLOCK_N, GROUPS, TOKENS, ASM, USE_PDL)
    if GATED:
        rows = first + tl.arange(0, HALF)
        rmask = rows < N
    _finish(y0, t0, T, out_ptr, res_ptr, rows, rmask, N, sr, RES, GATED, DTYPE, HALF)
    if TOKENS > 1:
        _finish(y1, t0 + 1, T, out_ptr, res_ptr, rows, rmask, N, sr, RES, GATED, DTYPE, HALF)
    if TOKENS > 2:
        _finish(y2, t0 + 2, T, out_ptr, res_ptr, rows, rmask, N, sr, RES, GATED, DTYPE, HALF)
        _finish(y3, t0 + 3, T, out_ptr, res_ptr, rows, rmask, N, sr, RES, GATED, DTYPE, HALF)


Config = tuple[int, int, int]  # (BLOCK_N, GROUPS, num_warps)


def config(n: int, every: int) -> Config:
    """2 rows a program for weights of 16384 rows or more (gate_up's [Wg; Wu]: a gate row
    and its up row; the LM head), else 4; one block a lane of a single warp. From a sweep
    of the Llama-8B layers (docs/benchmarks.md)."""
    return (2 if n >= 16384 else 4), max(32, every), 1


def scale_span(qw: QuantWeight) -> tuple[int, int]:
    """(blocks of 32 columns a scale covers, scales a block) of a q4 or q8 weight."""
    return (1, 32 // qw.group) if qw.method == Q8 else (qw.group // 32, 1)


def quantize(x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
             q8: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int16 pairs int32 [T, K / 2] in the order q4's products take them, or q8's, scales
    [T, K / 32], sums [T, K / 32]) of x [T, K] (rows of unit stride, K a multiple of 32), or
    of its RMSNorm by `norm_weight` [K]."""
    t, k = x.shape
    nb = k // 32
    xq = torch.empty(t, k // 2, dtype=torch.int32, device=x.device)
    xs = torch.empty(t, nb, dtype=torch.float32, device=x.device)
    xsum = torch.empty(t, nb, dtype=torch.float32, device=x.device)
    _quantize_kernel[(triton.cdiv(nb, QUANT_BLOCKS), t)](
        x, norm_weight if norm_weight is not None else x, xq, xs, xsum, k, x.stride(0), eps, BLOCKS=QUANT_BLOCKS,
        NORM=norm_weight is not None, Q8=q8, num_warps=4, **pdl_flags(x.device))
    return xq, xs, xsum


def gemv_x16(x: torch.Tensor, qw: QuantWeight, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
             residual: torch.Tensor | None = None, gated: bool = False, out_dtype: torch.dtype | None = None,
             launch: Config | None = None) -> torch.Tensor:
    """x [T, K] (half; `takes`) times the q4 or q8 weight [N, K] -> [T, N]; with `norm_weight` of
    x's RMSNorm (one launch with the rounding to int16), plus `residual` [T, N], or with
    `gated` silu(Wg x) * (Wu x) of W = [Wg; Wu] -> [T, N / 2]; each rounded as its torch op
    (kernels.gemv's `_packed_gemv` order). `launch`: (BLOCK_N, GROUPS, num_warps) instead of
    `config`'s."""
    rows, k = qw.shape
    t = x.shape[0]
    n = rows // 2 if gated else rows
    q8 = qw.method == Q8
    every, sub = scale_span(qw)
    block_n, groups, warps = launch or config(rows, every)
    assert groups % every == 0 and k % 32 == 0 and (block_n % 2 == 0 or not gated), (groups, every, k, block_n)
    x = x.reshape(t, k)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(t, n, dtype=out_dtype or x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == (t, n) and residual.dtype == x.dtype, (residual.shape, residual.dtype)
        if residual.stride(1) != 1:
            residual = residual.contiguous()
    xq, xs, xsum = quantize(x, norm_weight, eps, q8)
    data = qw.data if qw.data.stride(1) == 1 else qw.data.contiguous()
    words = data.view(torch.int32)
    scale = qw.scale if qw.scale.stride(1) == 1 else qw.scale.contiguous()
    offset = qw.zeros if qw.zeros is not None else scale
    tokens = 1 if t == 1 else 2 if t == 2 else 4
    res = residual if residual is not None else x
    _gemv_kernel[(triton.cdiv(t, tokens), triton.cdiv(n, block_n // 2 if gated else block_n))](
        xq, xs, xsum, words, scale, offset, out, res, t, n, k // 32, words.stride(0), scale.stride(0),
        offset.stride(0), res.stride(0),
        EVERY=every, SUB=sub, Q8=q8, OFFSET=qw.zeros is not None, RES=residual is not None, GATED=gated,
        BLOCK_N=block_n, GROUPS=groups, TOKENS=tokens, ASM=x.is_cuda, num_warps=warps, **pdl_flags(x.device))
    return out
