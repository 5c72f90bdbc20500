"""Few-token linear layers on int4 weights: y = x W^T with W dequantized in registers.

On a GPU a model's int4 layers whose groups and rows are whole blocks of 32 (every
AWQ/GPTQ group size in use: 32, 64, 128, a whole row) are held as q4 blocks of the same
values (models/layers.py `gpu_layout`), which kernels/blocks.py streams about twice as fast
as this kernel streams the int4 layout; this kernel serves the other group sizes and the
tests' direct calls.

The weight is our int4 layout (models/quant_int4.py): data uint8 [N, K / 2], two 4-bit
values a byte along K (even k in the low nibble), float32 scales and uint8 zero points
[N, groups], value (q - zero) * scale. At 1 to 32 tokens a linear layer is bound by
streaming its weight, and 4-bit bytes are a quarter of bf16's: each program owns BLOCK_N
rows and walks K in tiles of BLOCK_K values (BLOCK_K / 2 contiguous bytes a row), unpacks
the low and high nibbles, subtracts the zero point and multiplies by the group's scale in
fp32, rounds to x's dtype, and multiplies with x's even and odd columns: two tl.dot from 2
tokens on (tokens padded to 16 or 32; fp32 accumulate, IEEE for fp32 x), a multiply-reduce
at one. Past 32 tokens, grid axis 1 takes the tokens 32 at a time, each block streaming
the weight again: correct, but not a prefill path.

On the CPU (TRITON_INTERPRET, whose tl.dot multiplies bf16 as raw bits) the dot's half
operands are widened to fp32 first: the same products (a product of two half values is
exact in fp32) and the same fp32 accumulation.

Rounding contract: the reference is `models.quant_int4.linear_int4`, F.linear(x,
dequantize_int4(qw).to(x.dtype)), then `+ residual`, each rounded to x's dtype as torch
rounds it, then out_dtype; only the order of the dot's fp32 sums differs.

Tiles and groups: where `group` is a multiple of BLOCK_K (any power-of-two group from 32),
a tile lies inside one group and takes one scale and zero a row; otherwise (other group
sizes) each column gathers its own. A ragged last group, K not a multiple of BLOCK_K and N
not a multiple of BLOCK_N are masked. Callers reach this module through a
`kernels/__init__.py` entry point, never at module level. Its tiles (`_config`) are chosen
for correctness over any group size, not from a sweep.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.core.quant import QuantWeight

MAX_TOKENS = 32  # tokens a program multiplies; more go to further programs on grid axis 1


@triton.jit
def _scale_zero(s_ptr, z_ptr, rows, rmask, cols, cmask, ss, sz, group, k0, ONE_GROUP: tl.constexpr):
    """(scale, zero) in fp32 for W[rows, cols]: [BLOCK_N, 1] when the tile lies inside the
    group of column k0, else gathered per column [BLOCK_N, len(cols)]."""
    if ONE_GROUP:
        g = k0 // group
        s = tl.load(s_ptr + rows * ss + g, mask=rmask, other=0.0)[:, None]
        z = tl.load(z_ptr + rows * sz + g, mask=rmask, other=0).to(tl.float32)[:, None]
    else:
        m = rmask[:, None] & cmask[None, :]
        g = (cols // group)[None, :]
        s = tl.load(s_ptr + rows[:, None] * ss + g, mask=m, other=0.0)
        z = tl.load(z_ptr + rows[:, None] * sz + g, mask=m, other=0).to(tl.float32)
    return s, z


@triton.jit
def _int4_kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, res_ptr, T, N, K, group, sx, sq, ss, sz, so, sr,
                 RES: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr, ONE_GROUP: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
    DTYPE = x_ptr.dtype.element_ty
    HALF_K: tl.constexpr = BLOCK_K // 2
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    toks = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < T
    j = tl.arange(0, HALF_K)
    q_rows = q_ptr + rows[:, None].to(tl.int64) * sq
    if DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    else:
        acc2 = tl.zeros([BLOCK_N, HALF_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        b = k0 // 2 + j  # this tile's bytes: columns 2b (low nibble) and 2b + 1 (high)
        bmask = b < K // 2  # K is even: a byte is whole or past the end
        byte = tl.load(q_rows + b[None, :], mask=rmask[:, None] & bmask[None, :], other=0)
        s_lo, z_lo = _scale_zero(s_ptr, z_ptr, rows, rmask, 2 * b, bmask, ss, sz, group, k0, ONE_GROUP)
        s_hi, z_hi = s_lo, z_lo
        if not ONE_GROUP:  # an odd group size may start at an odd column
            s_hi, z_hi = _scale_zero(s_ptr, z_ptr, rows, rmask, 2 * b + 1, bmask, ss, sz, group, k0, ONE_GROUP)
        w_lo = (((byte & 0xF).to(tl.float32) - z_lo) * s_lo).to(DTYPE)
        w_hi = (((byte >> 4).to(tl.float32) - z_hi) * s_hi).to(DTYPE)
        if DOT:  # x's even and odd columns as [HALF_K, BLOCK_T]
            xm = bmask[:, None] & tmask[None, :]
            x_at = x_ptr + toks[None, :] * sx + 2 * b[:, None]
            x_lo = tl.load(x_at, mask=xm, other=0.0)
            x_hi = tl.load(x_at + 1, mask=xm, other=0.0)
            acc = dot_halves(w_lo, w_hi, x_lo, x_hi, acc, IEEE, WIDEN)
        else:
            x_lo = tl.load(x_ptr + 2 * b, mask=bmask, other=0.0).to(tl.float32)
            x_hi = tl.load(x_ptr + 2 * b + 1, mask=bmask, other=0.0).to(tl.float32)
            acc2 += w_lo.to(tl.float32) * x_lo[None, :] + w_hi.to(tl.float32) * x_hi[None, :]
    if DOT:
        y = acc
    else:
        y = tl.sum(acc2, axis=1)[:, None]  # [BLOCK_N, 1]: BLOCK_T is 1
    store_tokens(y, out_ptr, res_ptr, rows, rmask, toks, tmask, so, sr, DTYPE, RES)


@triton.jit
def dot_halves(w_lo, w_hi, x_lo, x_hi, acc, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """acc + w_lo x_lo + w_hi x_hi by tl.dot (IEEE: fp32 operands). WIDEN (the
    interpreter, whose dot multiplies half types as raw bits): half operands widened to
    fp32 first, exact, as a product of two half values is exact in fp32."""
    if WIDEN:
        w_lo, w_hi = w_lo.to(tl.float32), w_hi.to(tl.float32)
        x_lo, x_hi = x_lo.to(tl.float32), x_hi.to(tl.float32)
    if IEEE or WIDEN:
        acc = tl.dot(w_lo, x_lo, acc, input_precision="ieee")
        acc = tl.dot(w_hi, x_hi, acc, input_precision="ieee")
    else:
        acc = tl.dot(w_lo, x_lo, acc)
        acc = tl.dot(w_hi, x_hi, acc)
    return acc


@triton.jit
def store_tokens(y, out_ptr, res_ptr, rows, rmask, toks, tmask, so, sr, DTYPE: tl.constexpr, RES: tl.constexpr):
    """out[toks, rows] = y [rows, toks] rounded to DTYPE as F.linear's output is, plus the
    residual (RES) rounded as torch's add is, then in out's dtype."""
    y = y.to(DTYPE).to(tl.float32)
    om = rmask[:, None] & tmask[None, :]
    if RES:
        r = tl.load(res_ptr + toks[None, :] * sr + rows[:, None], mask=om, other=0.0).to(tl.float32)
        y = (r + y).to(DTYPE).to(tl.float32)
    tl.store(out_ptr + toks[None, :] * so + rows[:, None], y.to(out_ptr.dtype.element_ty), mask=om)


def _config(n: int, k: int, group: int) -> tuple[int, int, bool]:
    """(BLOCK_N, BLOCK_K, ONE_GROUP): the deepest tile of 32 to 256 values inside one group,
    else 128 values with per-column scales; 32 rows a program (16 for narrow layers, so they
    still spread over programs)."""
    block_n = 32 if n >= 1024 else 16
    for block_k in (256, 128, 64, 32):
        if group % block_k == 0:
            return block_n, block_k, True
    return block_n, min(128, max(32, triton.next_power_of_2(k))), False


def operands(x: torch.Tensor, qw: QuantWeight, n: int, residual: torch.Tensor | None,
             out_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(x, the stored weight, out [T, n], residual), each with unit stride along its rows,
    for a packed-weight kernel (this file's, blocks.py's); the residual's shape and dtype
    checked."""
    if x.stride(1) != 1:
        x = x.contiguous()
    data = qw.data if qw.data.stride(1) == 1 else qw.data.contiguous()
    out = torch.empty(x.shape[0], n, dtype=out_dtype or x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == out.shape and residual.dtype == x.dtype, (residual.shape, residual.dtype)
        if residual.stride(1) != 1:
            residual = residual.contiguous()
    return x, data, out, residual


def int4_matmul(x: torch.Tensor, qw: QuantWeight, *, residual: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, K] (fp32, bf16 or fp16; T up to 32 is the intended use) times the int4 weight
    [N, K] -> [T, N]; plus residual [T, N] (x's dtype) when given. out_dtype: x's dtype
    unless given (the value is rounded to x's dtype first). See the module docstring."""
    assert qw.method == "int4" and qw.zeros is not None, qw.method
    t, k = x.shape
    n = int(qw.data.shape[0])
    assert qw.data.dtype == torch.uint8 and 2 * qw.data.shape[1] == k, (qw.data.shape, x.shape)
    assert qw.scale.shape == qw.zeros.shape == (n, -(-k // qw.group)), (qw.scale.shape, qw.zeros.shape)
    x, data, out, residual = operands(x, qw, n, residual, out_dtype)
    if t == 0:
        return out
    block_n, block_k, one_group = _config(n, k, qw.group)
    block_t = 1 if t == 1 else (16 if t <= 16 else MAX_TOKENS)
    scale, zeros = qw.scale.float(), qw.zeros
    grid = (triton.cdiv(n, block_n), triton.cdiv(t, block_t))
    _int4_kernel[grid](
        x, data, scale, zeros, out, residual if residual is not None else out, t, n, k, qw.group,
        x.stride(0), data.stride(0), scale.stride(0), zeros.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else 0,
        RES=residual is not None, DOT=t > 1, IEEE=x.dtype == torch.float32, WIDEN=x.device.type != "cuda",
        ONE_GROUP=one_group,
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_T=block_t, num_warps=4)
    return out
