"""q4 and q8 layers at MIN_TOKENS or more tokens of half x on tensor cores: each nibble read
as the half value MAGIC + u, by tl.dot against x's columns.

blocks.py's dot kernel turns every weight into x's dtype before its tl.dot (a shift, a
logic op, a multiply-add and a conversion a value), which holds a verify's layers far
below the memory's speed. Here the nibble u goes into the low mantissa bits of a half
value whose exponent makes it MAGIC + u exactly (bf16 0x4300 | u = 128 + u, fp16
0x6400 | u = 1024 + u): two values an `lop3` of inline PTX, the bytes first spread over a
word's halves by `prmt` (half_ptx.py). A q4 block's byte j holds column j in its low
nibble and j + 16 in its high one (core/quant.py), so the low nibbles of a K step's bytes
meet x's first 16 columns of each block, and the high ones the last 16, in two tl.dot.
Three kernels, by format and how many blocks a scale covers:
- Scale groups of 64 to 256 columns (AWQ/GPTQ's groups held as q4): the nibbles go into
  the dot as they are, d = sum x (MAGIC + u) over the group; then, in fp32,
  y += s (d - MAGIC sum(x)) + o sum(x). A K step takes SUBS scale groups one after
  another, so each step moves at least 64 bytes of a row (`_q4_dot_kernel`).
- One scale a block (GGUF's Q4_0, Q4_1, Q4_K): a dot per block would be 16 deep, so each
  weight is made before the dot instead, by two more half-pair instructions a pair:
  (MAGIC + u) * 1 - MAGIC = u, then u s + o with s and o in x's dtype
  (half_ptx.py); a K step takes SUBS blocks (`_q4_scaled_kernel`).
- q8 (a signed byte a column, a scale every 16 or 32 columns: GGUF's Q8_0, Q6_K, Q5_x):
  each weight made q s + o the same way before one dot a K step (`_q8_scaled_kernel`);
  bf16 holds no MAGIC + byte exactly, so u = q + 128 is split into its nibbles, and
  q = 16 (hi - 8) + lo is exact (half_ptx.py; fp16: q = (1024 + u) - 1152). From
  MIN_TOKENS_Q8 tokens.
split_k.py spreads narrow layers' rows over more programs and adds their parts.

Rounding contract. Groups of 64 to 256 columns: each weight is u s + o exactly
(blocks.py's reference rounds it to x's dtype first, so this kernel is the nearer to the
fp32 value); the products of half values are exact and summed in fp32 in the tensor
cores' order; subtracting MAGIC sum(x) costs at most a few ulps of fp32 of MAGIC sum|x|
over the group. One scale a block, and q8: s and o are rounded to x's dtype, then u s + o once
(the reference rounds only that sum), so a weight may differ from the reference's by
half an ulp of x's dtype of s and of o besides; the products are exact and summed in fp32.
Then y is rounded to x's dtype, the residual added and rounded, as int4.py `store_tokens`
does. On the CPU (TRITON_INTERPRET) the nibbles are widened to fp32 and the dot is fp32:
the same values (the scaled weights u s + o summed in fp32 before their rounding).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.core.quant import Q4, Q8, QuantWeight
from specserve.kernels import half_ptx, split_k
from specserve.kernels.int4 import dot_halves, operands
from specserve.kernels.pdl import wait_and_release

MAX_EVERY = 8  # blocks a scale covers here, a power of two: 1 (GGUF's) to 8 (groups of 256 columns)
# From 3 tokens these products take less time than blocks_x16.py's, which pay for each token
# (docs/benchmarks.md); from 5 on, than blocks.py's dot kernel
MIN_TOKENS = 3
MIN_TOKENS_Q8 = 4  # q8's layers at 3 tokens are as fast on blocks_x16.py (docs/benchmarks.md)

Launch = tuple[int, int, int, int, int]  # (BLOCK_N, SUBS, num_warps, num_stages, programs)


def takes(x: torch.Tensor, qw: QuantWeight) -> bool:
    """Whether this path serves x [T, K] times `qw`: MIN_TOKENS rows or more of half x on q4
    whose scales cover a power of two of blocks up to MAX_EVERY (GGUF's one a block,
    AWQ/GPTQ's groups of 64 to 256 columns), or on q8 (a scale every 16 or 32 columns:
    GGUF's Q8_0, Q6_K, Q5_x); blocks_x16.py's `takes` leaves these inputs to it."""
    if x.shape[0] < MIN_TOKENS or x.dtype not in half_ptx.MAGIC or qw.shape[1] % 32:
        return False
    if qw.method == Q8:
        return qw.group in (16, 32) and x.shape[0] >= MIN_TOKENS_Q8
    every = qw.group // 32
    return qw.method == Q4 and qw.group % 32 == 0 and 1 <= every <= MAX_EVERY and every & (every - 1) == 0


@triton.jit
def _nibbles(byte, x_ptr, HIGH: tl.constexpr, ASM: tl.constexpr, MAGIC: tl.constexpr):
    """MAGIC + u for the low (HIGH: high) nibble u of each uint8 of `byte`: in x's dtype by
    half_ptx.py's PTX (ASM, its string), else in fp32."""
    if ASM != "":
        w = tl.inline_asm_elementwise(ASM, "=r,=r,r", [byte], dtype=x_ptr.dtype.element_ty, is_pure=True, pack=4)
    elif HIGH:
        w = (byte >> 4).to(tl.float32) + MAGIC
    else:
        w = (byte & 0xF).to(tl.float32) + MAGIC
    return w


@triton.jit
def _q4_program(x_ptr, q_ptr, T, N, K, GPS, sx, sq, HK: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_T: tl.constexpr):
    """A q4 program's tile (split_k.py `program_tile`), its blocks [first, end), and for a K
    step of HK bytes a row: each byte's block, and the pointers of its bytes [BLOCK_N, HK]
    and of x's columns [HK, BLOCK_T] for its low nibbles (byte e: block e // 16, column
    32 (e // 16) + e % 16; the high nibbles' are 16 further)."""
    rows, rmask, toks, tmask = split_k.program_tile(T, N, BLOCK_N, BLOCK_T)
    first = tl.program_id(2) * GPS
    end = tl.minimum(K // 32, first + GPS)
    e = tl.arange(0, HK)
    blk = e // 16
    q_rows = q_ptr + rows[:, None].to(tl.int64) * sq + e[None, :]
    x_cols = x_ptr + toks[None, :] * sx + (blk * 32 + e % 16)[:, None]
    return rows, rmask, toks, tmask, first, end, blk, q_rows, x_cols


@triton.jit
def _q4_dot_kernel(x_ptr, q_ptr, s_ptr, o_ptr, out_ptr, res_ptr, part_ptr, T, N, K, GPS, sx, sq, ss, so, sout, sr,
                   EVERY: tl.constexpr, OFFSET: tl.constexpr, LO_ASM: tl.constexpr, HI_ASM: tl.constexpr,
                   MAGIC: tl.constexpr, SUBS: tl.constexpr, RES: tl.constexpr, SPLIT: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (n, t, p): rows n, tokens t, the GPS blocks from p * GPS on (whole scale
    groups), a scale group at a time; with SPLIT > 1 its fp32 sums go to part[p]
    (split_k.py), else the finished rows."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    HK: tl.constexpr = EVERY * 16  # a scale group's bytes: a dot's depth
    wait_and_release(USE_PDL)
    rows, rmask, toks, tmask, first, end, blk, q_rows, x_cols = _q4_program(
        x_ptr, q_ptr, T, N, K, GPS, sx, sq, HK, BLOCK_N, BLOCK_T)
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for g0 in range(first, end, EVERY * SUBS):
        for i in tl.static_range(SUBS):
            g = g0 + i * EVERY  # the group's first block
            bmask = g + blk < end
            byte = tl.load(q_rows + g * 16, mask=rmask[:, None] & bmask[None, :], other=0)
            xm = bmask[:, None] & tmask[None, :]
            x_lo = tl.load(x_cols + g * 32, mask=xm, other=0.0)
            x_hi = tl.load(x_cols + g * 32 + 16, mask=xm, other=0.0)
            sg = tl.minimum(g, end - 1) // EVERY  # past the end, x's zeros make any scale's term 0
            s = tl.load(s_ptr + rows * ss + sg, mask=rmask, other=0.0).to(tl.float32)
            w_lo = _nibbles(byte, x_ptr, False, LO_ASM, MAGIC)
            w_hi = _nibbles(byte, x_ptr, True, HI_ASM, MAGIC)
            d = dot_halves(w_lo, w_hi, x_lo, x_hi, tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32),
                           LO_ASM == "", LO_ASM == "")
            x_sum = (tl.sum(x_lo.to(tl.float32), axis=0) + tl.sum(x_hi.to(tl.float32), axis=0))[None, :]
            acc += s[:, None] * (d - MAGIC * x_sum)
            if OFFSET:
                acc += tl.load(o_ptr + rows * so + sg, mask=rmask, other=0.0).to(tl.float32)[:, None] * x_sum
    split_k.finish(acc, part_ptr, out_ptr, res_ptr, rows, rmask, toks, tmask, T, N, sout, sr, DTYPE, RES, SPLIT)


@triton.jit
def _block_pairs(v, BLOCK_N: tl.constexpr, SUBS: tl.constexpr, WIDTH: tl.constexpr = 16):
    """[BLOCK_N, SUBS] values spread over the WIDTH bytes each covers: [BLOCK_N, SUBS * WIDTH]."""
    return tl.reshape(tl.broadcast_to(v[:, :, None], [BLOCK_N, SUBS, WIDTH]), [BLOCK_N, SUBS * WIDTH])


@triton.jit
def _scaled(byte, s, o, x_ptr, HIGH: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr, SUBS: tl.constexpr):
    """u s + o in x's dtype for the low (HIGH: high) nibble u of each uint8 of `byte`
    [BLOCK_N, SUBS * 16], s and o [BLOCK_N, SUBS] its block's scale and offset (fp32),
    each rounded to x's dtype first: by half_ptx.py's PTX (ASM, its string; s and o as half
    pairs (v, v) in an int32), else in fp32 and rounded."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    if ASM != "":
        hs = s.to(DTYPE).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        ho = o.to(DTYPE).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        sp = _block_pairs(hs | (hs << 16), BLOCK_N, SUBS)
        op = _block_pairs(ho | (ho << 16), BLOCK_N, SUBS)
        return tl.inline_asm_elementwise(ASM, "=r,=r,r,r,r,r,r,r,r,r,r", [byte, sp, op],
                                         dtype=x_ptr.dtype.element_ty, is_pure=True, pack=4)
    u = (byte >> 4) if HIGH else (byte & 0xF)
    s = _block_pairs(s.to(DTYPE).to(tl.float32), BLOCK_N, SUBS)
    return (u.to(tl.float32) * s + _block_pairs(o.to(DTYPE).to(tl.float32), BLOCK_N, SUBS)).to(DTYPE)


@triton.jit
def _q4_scaled_kernel(x_ptr, q_ptr, s_ptr, o_ptr, out_ptr, res_ptr, part_ptr, T, N, K, GPS, sx, sq, ss, so, sout, sr,
                      OFFSET: tl.constexpr, LO_ASM: tl.constexpr, HI_ASM: tl.constexpr, SUBS: tl.constexpr,
                      RES: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
                      USE_PDL: tl.constexpr):
    """Program (n, t, p) on one scale a block: rows n, tokens t, the GPS blocks from
    p * GPS on, SUBS blocks a K step, each weight made (`_scaled`) before the step's two
    dots; with SPLIT > 1 its fp32 sums go to part[p] (split_k.py), else the finished rows."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    HK: tl.constexpr = SUBS * 16  # a step's bytes of a row: the dots' depth
    wait_and_release(USE_PDL)
    rows, rmask, toks, tmask, first, end, blk, q_rows, x_cols = _q4_program(
        x_ptr, q_ptr, T, N, K, GPS, sx, sq, HK, BLOCK_N, BLOCK_T)
    bi = tl.arange(0, SUBS)
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for g in range(first, end, SUBS):
        bmask = g + blk < end
        byte = tl.load(q_rows + g * 16, mask=rmask[:, None] & bmask[None, :], other=0)
        sm = rmask[:, None] & (g + bi < end)[None, :]
        s = tl.load(s_ptr + rows[:, None] * ss + g + bi[None, :], mask=sm, other=0.0).to(tl.float32)
        o = tl.zeros_like(s)
        if OFFSET:
            o = tl.load(o_ptr + rows[:, None] * so + g + bi[None, :], mask=sm, other=0.0).to(tl.float32)
        xm = bmask[:, None] & tmask[None, :]
        x_lo = tl.load(x_cols + g * 32, mask=xm, other=0.0)
        x_hi = tl.load(x_cols + g * 32 + 16, mask=xm, other=0.0)
        w_lo = _scaled(byte, s, o, x_ptr, False, LO_ASM, BLOCK_N, SUBS)
        w_hi = _scaled(byte, s, o, x_ptr, True, HI_ASM, BLOCK_N, SUBS)
        acc = dot_halves(w_lo, w_hi, x_lo, x_hi, acc, False, LO_ASM == "")
    split_k.finish(acc, part_ptr, out_ptr, res_ptr, rows, rmask, toks, tmask, T, N, sout, sr, DTYPE, RES, SPLIT)


@triton.jit
def _q8_scaled_kernel(x_ptr, q_ptr, s_ptr, o_ptr, out_ptr, res_ptr, part_ptr, T, N, K, GPS, sx, sq, ss, so, sout, sr,
                      SPAN: tl.constexpr, OFFSET: tl.constexpr, ASM: tl.constexpr, SUBS: tl.constexpr,
                      RES: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
                      USE_PDL: tl.constexpr):
    """Program (n, t, p) on q8 (a byte a column, a scale every SPAN columns): rows n, tokens
    t, the GPS blocks of 32 columns from p * GPS on, SUBS blocks a K step, each weight made
    q s + o in x's dtype (half_ptx.py's PTX; on the CPU in fp32, rounded) before the step's dot."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    HK: tl.constexpr = SUBS * 32  # a step's columns
    NSC: tl.constexpr = HK // SPAN  # its scales
    wait_and_release(USE_PDL)
    rows, rmask, toks, tmask = split_k.program_tile(T, N, BLOCK_N, BLOCK_T)
    first = tl.program_id(2) * GPS
    end = tl.minimum(K // 32, first + GPS) * 32  # columns
    e = tl.arange(0, HK)
    si = tl.arange(0, NSC)
    q_rows = q_ptr + rows[:, None].to(tl.int64) * sq + e[None, :]
    x_cols = x_ptr + toks[None, :] * sx + e[:, None]  # [HK, BLOCK_T]
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for c in range(first * 32, end, HK):
        cmask = c + e < end
        byte = tl.load(q_rows + c, mask=rmask[:, None] & cmask[None, :], other=0)
        sc = c // SPAN + si
        sm = rmask[:, None] & (sc < end // SPAN)[None, :]
        s = tl.load(s_ptr + rows[:, None] * ss + sc[None, :], mask=sm, other=0.0).to(tl.float32).to(DTYPE)
        o = tl.zeros_like(s)
        if OFFSET:
            o = tl.load(o_ptr + rows[:, None] * so + sc[None, :], mask=sm, other=0.0).to(tl.float32).to(DTYPE)
        xv = tl.load(x_cols + c, mask=cmask[:, None] & tmask[None, :], other=0.0)
        if ASM != "":
            hs = s.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            ho = o.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            w = tl.inline_asm_elementwise(ASM, "=r,=r,r,r,r,r,r,r,r,r,r",
                                          [byte, _block_pairs(hs | (hs << 16), BLOCK_N, NSC, SPAN),
                                           _block_pairs(ho | (ho << 16), BLOCK_N, NSC, SPAN)],
                                          dtype=x_ptr.dtype.element_ty, is_pure=True, pack=4)
            acc = tl.dot(w, xv, acc)
        else:  # the interpreter: the same weights, the dot in fp32
            w = (byte.to(tl.float32) * _block_pairs(s.to(tl.float32), BLOCK_N, NSC, SPAN)
                 + _block_pairs(o.to(tl.float32), BLOCK_N, NSC, SPAN)).to(DTYPE)
            acc = tl.dot(w.to(tl.float32), xv.to(tl.float32), acc, input_precision="ieee")
    split_k.finish(acc, part_ptr, out_ptr, res_ptr, rows, rmask, toks, tmask, T, N, sout, sr, DTYPE, RES, SPLIT)


def config(n: int, k: int, every: int, tokens: int = 16) -> Launch:
    """(BLOCK_N, SUBS, num_warps, num_stages, programs) for `tokens` rows of x; `every`: the
    blocks a q4 scale covers, 0 for q8. Scale groups of 64 to 256 columns: 128 rows and 8
    warps for a wide layer (16384 rows or more, or 8192 columns: an MLP's), 64 and 4 for a
    narrow one; scale groups of 128 columns a K step; each row's blocks split until the
    tiles make `programs` programs (split_k.py), fewer for narrow layers. One scale a block:
    64 rows, 4 warps, 8 blocks a step and 256 programs, but for a wide layer past 16 tokens
    128 rows, 8 warps and 4 blocks. q8: 64 rows and 4 warps, 4 blocks a step and 256
    programs (8 blocks for 8192 columns or more; gate_up 2 blocks and 512 programs). 16 rows
    below 1024. From sweeps on the Llama-8B layers at 3 to 32 tokens (docs/benchmarks.md)."""
    wide = n >= 16384 or k >= 8192
    if every == 0:
        if n >= 16384 and n < 65536:  # an MLP's gate_up (not an LM head)
            return 64, 2, 4, 3, 512
        return (16 if n < 1024 else 64), (8 if k >= 8192 else 4), 4, 3, 256
    if every == 1 and not (wide and tokens > 16):
        return (16 if n < 1024 else 64), 8, 4, 3, 256
    block_n = 16 if n < 1024 else (128 if wide else 64)
    subs = 4 if every == 1 else max(1, 4 // every)
    return block_n, subs, 8 if wide else 4, 3, 512 if wide else 256


def tc_matmul(x: torch.Tensor, qw: QuantWeight, *, residual: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None, launch: Launch | None = None) -> torch.Tensor:
    """x [T, K] (bf16 or fp16; `takes`) times the q4 or q8 weight [N, K] -> [T, N], plus
    residual [T, N] when given; out_dtype: x's dtype unless given. `launch`: instead of
    `config`'s (tuning). Tokens past 32 go to further programs, each streaming the weight
    again."""
    assert takes(x, qw), (x.shape, x.dtype, qw.method, qw.group)
    n, k = qw.shape
    every = 0 if qw.method == Q8 else qw.group // 32
    x, data, out, residual = operands(x, qw, n, residual, out_dtype)
    block_n, subs, warps, stages, programs = launch or config(n, k, every, x.shape[0])
    scale = qw.scale if qw.scale.stride(1) == 1 else qw.scale.contiguous()
    offset = qw.zeros if qw.zeros is not None else scale
    block_t = 16 if x.shape[0] <= 16 else 32
    tile = (block_n, block_t, max(every, 1) * subs)
    common = dict(OFFSET=qw.zeros is not None, SUBS=subs, num_stages=stages, programs=programs)
    if every == 0:
        return split_k.launch(_q8_scaled_kernel, x, data, scale, offset, out, residual, k // 32, tile, warps,
                              SPAN=qw.group, ASM=half_ptx.q8_values(x.dtype) if x.is_cuda else "", **common)
    lo, hi = half_ptx.nibble_values(x.dtype, scaled=every == 1) if x.is_cuda else ("", "")
    if every == 1:
        return split_k.launch(_q4_scaled_kernel, x, data, scale, offset, out, residual, k // 32, tile, warps,
                              LO_ASM=lo, HI_ASM=hi, **common)
    return split_k.launch(_q4_dot_kernel, x, data, scale, offset, out, residual, k // 32, tile, warps,
                          EVERY=every, LO_ASM=lo, HI_ASM=hi, MAGIC=half_ptx.MAGIC[x.dtype], **common)

