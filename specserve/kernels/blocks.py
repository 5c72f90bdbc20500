"""Few-token linear layers on a GGUF's blocks: y = x W^T with W dequantized in registers.

The weight is a q4 or q8 `QuantWeight` (core/quant.py; models/gguf_blocks.py repacks
GGUF's Q4_0/Q4_1/Q4_K into q4 and Q8_0/Q6_K/Q5_x into q8): per `group` input columns of a
row, one scale and, where the format has one, one offset (GGUF's min), value q * scale +
offset. q4 packs a block of 32 columns in 16 bytes, byte j holding column j in its low
nibble and column j + 16 in its high one; q8 holds one int8 a column. A q4 scale may cover
several blocks (`group` a multiple of 32: AWQ/GPTQ weights held as q4, core/quant.py
`int4_to_q4`); below, "group" means a block. Scales and offsets may be float32 or float16
(models/gguf_serve.py narrows them where that is exact); they are widened to fp32 in
registers either way.

Each program owns BLOCK_N rows and walks K a tile of GROUPS whole groups at a time. No
value is converted by a conversion instruction, which runs at a fraction of the rate of
the arithmetic and would bound the kernel below the memory's speed: its bits are shifted
into the top of an fp32 mantissa under 1.0's exponent (`_unit_floats`), a float 1 + u / 16
(q4's nibble u) or 1 + u / 256 (q8's byte as offset binary u = q + 128).
- Half-precision x goes elsewhere where those kernels are faster: from
  blocks_tc.MIN_TOKENS tokens on (q8: MIN_TOKENS_Q8), to blocks_tc.py (tensor cores on the
  weights made half values by bit operations); else up to blocks_x16.MAX_TOKENS to
  blocks_x16.py (x rounded to int16 a block, integer dot products). Each module's `takes`
  says which inputs it serves; this file's kernels keep fp32 x and what neither takes.
- One token otherwise (`_gemv_blocks_kernel`): the weight is read as int32 words. Per
  group it sums x times those unit floats and x alone, recovers sum(x q) from the two,
  then adds s sum(x q) + o sum(x): a shift, a logic op and a multiply-add a column. Each
  weight is thus its fp32 value q s + o, not rounded to x's dtype.
- Two tokens or more (`_blocks_kernel`): a group splits into two halves of H columns (q4:
  the low and high nibbles of its 16 bytes; q8: its first and last H columns), each value
  one multiply-add from its unit float, rounded to x's dtype, and multiplied with x's
  halves by two tl.dot (tokens padded to 16 or 32; fp32 accumulate, IEEE for fp32 x).
  Past 32 tokens, grid axis 1 takes the tokens 32 at a time, each block streaming the
  weight again. A layer with few output tiles splits each row's groups over up to 8
  programs whose fp32 sums a second launch adds in order (split_k.py).

On the CPU (TRITON_INTERPRET) the dot's half operands are widened to fp32 first, as in
int4.py: the same products and the same fp32 accumulation.

Rounding contract: the reference is F.linear(x, qw.dequantize(x.dtype)), then
`+ residual`, each rounded to x's dtype as torch rounds it, then out_dtype. Besides the
order of the fp32 sums, the value of a weight may differ from the reference's fp32
q * scale + offset by fp32 rounding (a fused multiply-add of the unit float), and at one
token it is not rounded to x's dtype (the CPU's kernel does not round it either).
Requirements: K a multiple of the block (GGUF's rows are whole blocks), group 16 or 32 for
q8 and a multiple of 32 for q4 (its last scale may then cover fewer blocks). Callers reach
this module through `kernels/__init__.py`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.core.quant import Q4, Q8, QuantWeight
from specserve.kernels import blocks_tc, blocks_x16, pdl_flags, split_k
from specserve.kernels.blocks_x16 import block_tile
from specserve.kernels.int4 import dot_halves, operands
from specserve.kernels.pdl import wait_and_release

MAX_TOKENS = 32  # tokens a program multiplies; more go to further programs on grid axis 1


@triton.jit
def _unit_floats(v, SHIFT: tl.constexpr, Q4_: tl.constexpr):
    """fp32 values 1 + u / 16 (q4: u the nibble of int32 `v` at bit -SHIFT + 19) or
    1 + u / 256 (q8: u = q + 128, q the signed byte of `v` at bit -SHIFT + 15): the bits
    shifted into the top of an fp32 mantissa under the exponent of 1.0, which costs a shift
    and a logic op where a conversion instruction runs at a fraction of their rate."""
    if SHIFT > 0:
        v = v << SHIFT
    elif SHIFT < 0:
        v = v >> -SHIFT
    if Q4_:
        bits = (v & 0x780000) | 0x3F800000
    else:  # the byte's sign bit flipped: offset binary q + 128
        bits = (v & 0x7F8000) ^ 0x3FC00000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _halves(q_ptr, s_ptr, o_ptr, rows, rmask, g, gmask, j, sq, ss, so, EVERY: tl.constexpr, GROUP: tl.constexpr,
            Q4_: tl.constexpr, OFFSET: tl.constexpr, DTYPE: tl.constexpr):
    """The two halves [BLOCK_N, GROUPS, H] of groups g of rows, dequantized and rounded to
    DTYPE: q4's low and high nibbles, q8's first and last H columns. A value is one fused
    multiply-add of its unit float (`_unit_floats`): q4 f * 16s + (o - 16s), q8
    f * 256s + (o - 384s)."""
    H: tl.constexpr = GROUP // 2
    m = rmask[:, None, None] & gmask[None, :, None]
    at = q_ptr + rows[:, None, None].to(tl.int64) * sq + g[None, :, None] * (H if Q4_ else GROUP) + j[None, None, :]
    sg = rows[:, None] * ss + g[None, :] // EVERY
    sm = rmask[:, None] & gmask[None, :]
    s = tl.load(s_ptr + sg, mask=sm, other=0.0).to(tl.float32)
    o = tl.zeros_like(s)
    if OFFSET:
        o = tl.load(o_ptr + sg, mask=sm, other=0.0).to(tl.float32)
    if Q4_:
        byte = tl.load(at, mask=m, other=0).to(tl.int32)
        lo, hi = _unit_floats(byte, 19, True), _unit_floats(byte, 15, True)
        mul, add = 16.0 * s, o - 16.0 * s
    else:
        lo = _unit_floats(tl.load(at, mask=m, other=0).to(tl.int32), 15, False)
        hi = _unit_floats(tl.load(at + H, mask=m, other=0).to(tl.int32), 15, False)
        mul, add = 256.0 * s, o - 384.0 * s
    lo = lo * mul[:, :, None] + add[:, :, None]
    hi = hi * mul[:, :, None] + add[:, :, None]
    return lo.to(DTYPE), hi.to(DTYPE)


@triton.jit
def _gemv_blocks_kernel(x_ptr, w_ptr, s_ptr, o_ptr, out_ptr, res_ptr, N, NG, sw, ss, so,
                        GROUP: tl.constexpr, EVERY: tl.constexpr, Q4_: tl.constexpr, OFFSET: tl.constexpr,
                        RES: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, USE_PDL: tl.constexpr):
    """One token: y = W x over int32 words of the blocks, [BLOCK_N, GROUPS, words a group]
    a tile, their four bytes taken in turn. Per group it sums x times each value's unit
    float (`_unit_floats`) and x alone, and recovers sum(x q) from the two: q4
    16 (sum(x f) - sum(x)), q8 256 (sum(x f) - sum(x)) - 128 sum(x); then
    y += s sum(x q) + o sum(x). Each column costs a shift, a logic op and a multiply-add.
    The next tile's loads are issued before this one's arithmetic, the first before the
    PDL wait (no earlier kernel writes the weights)."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    WPG: tl.constexpr = 4 if Q4_ else GROUP // 4  # int32 words a group
    SG: tl.constexpr = GROUPS // EVERY  # scales a tile
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    gi = tl.arange(0, GROUPS)
    si = tl.arange(0, SG)
    wi = tl.arange(0, WPG)
    w_rows = w_ptr + rows[:, None, None].to(tl.int64) * sw
    NS = (NG + EVERY - 1) // EVERY  # scales a row (the last may cover fewer blocks)
    words, s, o = block_tile(w_rows, s_ptr, o_ptr, rows, rmask, gi, gi < NG, si, si < NS, ss, so, WPG, OFFSET)
    wait_and_release(USE_PDL)  # past this, every earlier kernel's writes (x, residual) are visible
    acc = tl.zeros([BLOCK_N, SG], dtype=tl.float32)
    for g0 in range(0, NG, GROUPS):
        g = g0 + gi
        gmask = g < NG
        gs = g0 // EVERY + SG + si
        words_n, s_n, o_n = block_tile(w_rows, s_ptr, o_ptr, rows, rmask, g + GROUPS, g + GROUPS < NG, gs,
                                       gs < NS, ss, so, WPG, OFFSET)
        col0 = g[:, None] * GROUP + wi[None, :] * 4  # [GROUPS, WPG]: the column of each word's first byte
        xm = gmask[:, None] & (wi < WPG)[None, :]
        part = tl.zeros([BLOCK_N, GROUPS, WPG], dtype=tl.float32)
        xs = tl.zeros([GROUPS, WPG], dtype=tl.float32)
        for b in tl.static_range(4):
            x_b = tl.load(x_ptr + col0 + b, mask=xm, other=0.0).to(tl.float32)
            xs += x_b
            if Q4_:  # byte b: its low nibble is column 4i + b, its high one 4i + b + 16
                part += _unit_floats(words, 19 - 8 * b, True) * x_b[None, :, :]
                x_h = tl.load(x_ptr + col0 + b + 16, mask=xm, other=0.0).to(tl.float32)
                xs += x_h
                part += _unit_floats(words, 15 - 8 * b, True) * x_h[None, :, :]
            else:
                part += _unit_floats(words, 15 - 8 * b, False) * x_b[None, :, :]
        xf = tl.sum(part, axis=2)  # [BLOCK_N, GROUPS]
        x_sum = tl.sum(xs, axis=1)[None, :]
        if Q4_:
            xq = 16.0 * (xf - x_sum)
        else:
            xq = 256.0 * (xf - x_sum) - 128.0 * x_sum
        if EVERY > 1:  # the sums of the blocks that share a scale
            xq = tl.sum(tl.reshape(xq, [BLOCK_N, SG, EVERY]), axis=2)
            x_sum = tl.sum(tl.reshape(x_sum, [1, SG, EVERY]), axis=2)
        acc += s * xq + o * x_sum
        words, s, o = words_n, s_n, o_n
    y = tl.sum(acc, axis=1).to(DTYPE).to(tl.float32)  # F.linear's output, rounded to x's dtype
    if RES:
        y = (tl.load(res_ptr + rows, mask=rmask, other=0.0).to(tl.float32) + y).to(DTYPE).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _blocks_kernel(x_ptr, q_ptr, s_ptr, o_ptr, out_ptr, res_ptr, part_ptr, T, N, K, GPS, sx, sq, ss, so, sout, sr,
                   GROUP: tl.constexpr, EVERY: tl.constexpr, Q4_: tl.constexpr, OFFSET: tl.constexpr,
                   RES: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr,
                   BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, BLOCK_T: tl.constexpr, USE_PDL: tl.constexpr):
    """Two tokens or more: the dequantized halves (`_halves`) times x's through tl.dot.
    Program (n, t, p) takes GPS groups from group p * GPS on; with SPLIT > 1 it writes
    its fp32 sums to part[p] (split_k.py), else the finished rows."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    H: tl.constexpr = GROUP // 2
    wait_and_release(USE_PDL)
    rows, rmask, toks, tmask = split_k.program_tile(T, N, BLOCK_N, BLOCK_T)
    first = tl.program_id(2) * GPS
    gi = tl.arange(0, GROUPS)
    j = tl.arange(0, H)
    n_groups = tl.minimum(K // GROUP, first + GPS)
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for g0 in range(first, n_groups, GROUPS):
        g = g0 + gi
        gmask = g < n_groups
        w_lo, w_hi = _halves(q_ptr, s_ptr, o_ptr, rows, rmask, g, gmask, j, sq, ss, so, EVERY, GROUP, Q4_, OFFSET,
                             DTYPE)
        # x's two halves as [GROUPS * H, BLOCK_T]: the low half's columns, and + H
        cols = tl.reshape(g[:, None] * GROUP + j[None, :], [GROUPS * H])
        xm = tl.reshape(gmask[:, None] & (j < H)[None, :], [GROUPS * H])[:, None] & tmask[None, :]
        x_at = x_ptr + toks[None, :] * sx + cols[:, None]
        x_lo = tl.load(x_at, mask=xm, other=0.0)
        x_hi = tl.load(x_at + H, mask=xm, other=0.0)
        w_lo = tl.reshape(w_lo, [BLOCK_N, GROUPS * H])
        w_hi = tl.reshape(w_hi, [BLOCK_N, GROUPS * H])
        acc = dot_halves(w_lo, w_hi, x_lo, x_hi, acc, IEEE, WIDEN)
    split_k.finish(acc, part_ptr, out_ptr, res_ptr, rows, rmask, toks, tmask, T, N, sout, sr, DTYPE, RES, SPLIT)


Config = tuple[int, int, int]  # (BLOCK_N, GROUPS, num_warps)


def config(n: int, k: int, group: int, tokens: int, method: str = Q4) -> Config:
    """The launch shape. One token: q4 16 rows a program, 64 groups a tile with 4 warps (a
    layer of 16384 rows or more: 32 rows, 8 groups, one warp); q8 16 rows, 256 columns,
    one warp. From two tokens on: 32 rows and 128 columns (the dot's tiles; 16 rows for
    narrow layers so they still spread over the SMs). Never more groups than a row holds,
    but at least 32 columns. Chosen from sweeps over the Llama-8B and SmolLM2 layer shapes
    (`specserve bench blocks --launch`; docs/benchmarks.md)."""
    if tokens == 1 and method == Q4:
        block_n, cols, warps = (32, 8 * group, 1) if n >= 16384 else (16, 64 * group, 4)
    elif tokens == 1:
        block_n, cols, warps = 16, 256, 1
    else:
        block_n, cols, warps = (32 if n >= 1024 else 16), 128, 4
    groups = min(cols // group, triton.next_power_of_2(k // group))
    return block_n, max(groups, 32 // group), warps  # a dot's K side is at least 16 columns


def blocks_matmul(x: torch.Tensor, qw: QuantWeight, *, residual: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, launch: Config | None = None) -> torch.Tensor:
    """x [T, K] (fp32, bf16 or fp16) times the q4/q8 weight [N, K] -> [T, N]; plus residual
    [T, N] (x's dtype) when given. out_dtype: x's dtype unless given (the value is rounded
    to x's dtype first). `launch`: (BLOCK_N, GROUPS, num_warps) instead of `config`'s, for
    tuning (it also keeps half x on this file's kernels instead of blocks_tc.py's or
    blocks_x16.py's). See the module docstring."""
    assert qw.method in (Q4, Q8), qw.method
    t, k = x.shape
    n, kw = qw.shape
    group = 32 if qw.method == Q4 else qw.group  # columns a block holds; a scale covers `every` blocks
    every = qw.group // group
    assert kw == k and k % group == 0 and qw.group % group == 0 and group in (16, 32), (qw.shape, x.shape, qw.group)
    assert qw.scale.shape == (n, -(-k // qw.group)), qw.scale.shape  # q4's last scale may cover fewer blocks
    assert qw.zeros is None or qw.zeros.shape == qw.scale.shape, qw.zeros.shape
    if launch is None and blocks_x16.takes(x, qw):  # a few tokens of half x: int16 dot products
        return blocks_x16.gemv_x16(x, qw, residual=residual, out_dtype=out_dtype)
    if launch is None and blocks_tc.takes(x, qw):  # 3+ tokens of half x on AWQ/GPTQ's groups: tensor cores
        return blocks_tc.tc_matmul(x, qw, residual=residual, out_dtype=out_dtype)
    x, data, out, residual = operands(x, qw, n, residual, out_dtype)
    if t == 0:
        return out
    block_n, groups, warps = launch or config(n, k, group, t, qw.method)
    assert t > 1 or groups % every == 0, (groups, every)  # a one-token tile holds whole scale groups
    scale = qw.scale if qw.scale.stride(1) == 1 else qw.scale.contiguous()
    offset = qw.zeros if qw.zeros is not None else scale
    if t == 1:  # the blocks as int32 words: a row's bytes are a multiple of 16
        words = data.view(torch.int32)
        _gemv_blocks_kernel[(triton.cdiv(n, block_n),)](
            x, words, scale, offset, out, residual if residual is not None else out, n, k // group,
            words.stride(0), scale.stride(0), offset.stride(0),
            GROUP=group, EVERY=every, Q4_=qw.method == Q4, OFFSET=qw.zeros is not None, RES=residual is not None,
            BLOCK_N=block_n, GROUPS=groups, num_warps=warps, **pdl_flags(x.device))
        return out
    block_t = 16 if t <= 16 else MAX_TOKENS
    return split_k.launch(
        _blocks_kernel, x, data, scale, offset, out, residual, k // group, (block_n, block_t, groups), warps,
        GROUP=group, EVERY=every, Q4_=qw.method == Q4, OFFSET=qw.zeros is not None,
        IEEE=x.dtype == torch.float32, WIDEN=x.device.type != "cuda", GROUPS=groups)
