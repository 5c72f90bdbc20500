"""One-token GEMV y = W x for batch-1 decoding, with the ops around it fused in.

At one token a linear layer streams its whole weight [N, K] to make N numbers, so its
speed is memory bandwidth, and the small ops between the layers are each a launch of
their own. This kernel (one or two rows of W per program, 1024 columns a load) streams
the weight closer to peak bandwidth than cuBLAS's GEMV does at one token, for wide and
narrow layers alike. Three epilogues/prologues take in the small ops of a decoder layer:
  norm:     y = W rmsnorm(x)            the pre-norm, x being the residual stream
  residual: y = r + W x                 the residual add after o_proj and down_proj
  gated:    y = silu(Wg x) * (Wu x)     gate_up's SiLU-and-mul, W = [Wg; Wu] ([2N, K])
so a layer is six launches (norm+qkv, RoPE+KV write, attention, o+residual, norm+gate_up,
down+residual) where the unfused path takes eight.

Numerics follow the unfused path op by op (`norm.py`, `activation.py`, torch's `+`):
the normed input is rounded to x's dtype as RMSNorm's output is, each dot is rounded to
x's dtype as F.linear's output is, and only then come the SiLU, the product and the
residual add, each rounded as its torch op rounds. Only the order of the dot's sums
differs from cuBLAS. Every program recomputes the norm's sum of squares over x (K values
from L2: cheaper than a launch).

A program fetches its first weight tile before anything else: the weights are no
earlier kernel's output. With programmatic dependent launch (`kernels.pdl_enabled`,
on by default on Hopper) that fetch overlaps the end of the kernel before, and the
program waits for that kernel only before reading x, so a decode step comes closer to
streaming its weights at copy bandwidth.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.core.quant import QuantWeight
from specserve.kernels import pdl_flags
from specserve.kernels.pdl import wait_and_release

_HALF = (torch.float16, torch.bfloat16)


def unpack(weight: torch.Tensor | QuantWeight) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(stored weight [N, K], scales [N, groups] or None, columns a scale covers) of a float
    or fp8 weight: the form every linear kernel takes."""
    if isinstance(weight, QuantWeight):
        assert weight.method == "fp8" and weight.scale.stride(1) == 1, (weight.method, weight.scale.stride())
        return weight.data, weight.scale, weight.group
    return weight, None, weight.shape[1]


@triton.jit
def _w_tile(w_ptr, rows, rmask, cols, kmask, sw, swk, EVEN_K: tl.constexpr):
    """W[rows, cols] in its own dtype. 64-bit offsets: vocab x hidden may pass 2^31;
    swk is 1 but on the CPU's [in, out] layout."""
    offs = rows[:, None].to(tl.int64) * sw + cols[None, :] * swk
    if EVEN_K:
        w = tl.load(w_ptr + offs, mask=rmask[:, None], other=0.0)
    else:
        w = tl.load(w_ptr + offs, mask=rmask[:, None] & kmask[None, :], other=0.0)
    return w


@triton.jit
def x_chunk(x_ptr, nw_ptr, cols, kmask, rstd, NORM: tl.constexpr, HALF: tl.constexpr, EVEN_K: tl.constexpr):
    """x[cols] in fp32, normalised as norm.py rounds it when NORM."""
    if EVEN_K:
        x = tl.load(x_ptr + cols).to(tl.float32)
    else:
        x = tl.load(x_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
    if NORM:
        g = tl.load(nw_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
        if HALF:  # normalise, round, then scale by the weight and round
            x = (g * (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)).to(x_ptr.dtype.element_ty)
            x = x.to(tl.float32)
        else:
            x = x * rstd * g
    return x


@triton.jit
def _w_scaled(w_ptr, s_ptr, rows, rmask, cols, kmask, sw, swk, sst, GROUP, EVEN_K: tl.constexpr,
              GROUPED: tl.constexpr):
    """W[rows, cols]: in its own dtype, or in fp32 times its group scales when GROUPED (fp8
    block scales)."""
    w = _w_tile(w_ptr, rows, rmask, cols, kmask, sw, swk, EVEN_K)
    if GROUPED:
        s_offs = rows[:, None] * sst + cols[None, :] // GROUP
        w = w.to(tl.float32) * tl.load(s_ptr + s_offs, mask=rmask[:, None] & kmask[None, :], other=0.0)
    return w


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, res_ptr, nw_ptr, N, K, sw, swk, sst, GROUP, eps,
                 NORM: tl.constexpr, RES: tl.constexpr, GATED: tl.constexpr, HALF: tl.constexpr,
                 SCALED: tl.constexpr, GROUPED: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    up_ptr = w_ptr + N.to(tl.int64) * sw  # GATED: the up rows follow the gate rows
    # At most 8 weights a load: fp8 rows would otherwise load 16 a thread, and x's tile
    # (8 half values a 16-byte load) would reach their layout through shared memory and two
    # barriers a tile
    cols = tl.max_contiguous(tl.arange(0, BLOCK_K), 8)
    kmask = cols < K
    # The weights are no earlier kernel's output: with PDL the first tile is on its way
    # while the kernel before this one finishes
    w = _w_scaled(w_ptr, s_ptr, rows, rmask, cols, kmask, sw, swk, sst, GROUP, EVEN_K, GROUPED)
    wu = w
    if GATED:
        wu = _w_scaled(up_ptr, s_ptr + N * sst, rows, rmask, cols, kmask, sw, swk, sst, GROUP, EVEN_K, GROUPED)
    row_s = tl.full([BLOCK_N], 1.0, tl.float32)
    row_su = row_s
    if SCALED and not GROUPED:  # one scale a row: applied to the sum
        row_s = tl.load(s_ptr + rows * sst, mask=rmask, other=0.0)
        if GATED:
            row_su = tl.load(s_ptr + (N + rows) * sst, mask=rmask, other=0.0)
    wait_and_release(USE_PDL)  # past this, every earlier kernel's writes (x, residual) are visible
    rstd = 1.0
    if NORM:  # rsqrt(mean(x^2) + eps) over the whole row, in fp32
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xs = tl.load(x_ptr + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            ss += xs * xs
        rstd = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    x = x_chunk(x_ptr, nw_ptr, cols, kmask, rstd, NORM, HALF, EVEN_K)
    acc = w.to(tl.float32) * x[None, :]
    acc_up = wu.to(tl.float32) * x[None, :]  # unused unless GATED
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kcols = k0 + cols
        kmask = kcols < K
        x = x_chunk(x_ptr, nw_ptr, kcols, kmask, rstd, NORM, HALF, EVEN_K)
        wt = _w_scaled(w_ptr, s_ptr, rows, rmask, kcols, kmask, sw, swk, sst, GROUP, EVEN_K, GROUPED)
        acc += wt.to(tl.float32) * x[None, :]
        if GATED:
            wut = _w_scaled(up_ptr, s_ptr + N * sst, rows, rmask, kcols, kmask, sw, swk, sst, GROUP, EVEN_K, GROUPED)
            acc_up += wut.to(tl.float32) * x[None, :]
    # each dot rounded as F.linear's output is
    y = (tl.sum(acc, axis=1) * row_s).to(x_ptr.dtype.element_ty).to(tl.float32)
    if GATED:  # activation.py: silu rounded, then the product
        up = (tl.sum(acc_up, axis=1) * row_su).to(x_ptr.dtype.element_ty).to(tl.float32)
        s = (y / (1.0 + tl.exp(-y))).to(x_ptr.dtype.element_ty).to(tl.float32)
        y = s * up
    if RES:
        y = tl.load(res_ptr + rows, mask=rmask, other=0.0).to(tl.float32) + y
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rmask)


def gemv(x: torch.Tensor, weight: torch.Tensor | QuantWeight, *, norm_weight: torch.Tensor | None = None,
         eps: float = 0.0, residual: torch.Tensor | None = None, gated: bool = False,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [1, K] (or [K]) times weight [N, K] -> [1, N] (see the module docstring for the
    fused forms; gated: weight [2N, K] -> [1, N]). The weight's rows should be contiguous
    (any strides work: the CPU tests pass a transposed [in, out] weight). out_dtype: x's
    dtype unless given (the value is rounded to x's dtype first, so float32 logits are the
    half logits widened). An fp8 `QuantWeight` is read as it is stored, each row's sum
    scaled (each tile scaled by its group's scale where the scales are grouped)."""
    weight, scale, group = unpack(weight)
    k = x.shape[-1]
    assert x.numel() == k and weight.dim() == 2 and weight.shape[1] == k, (x.shape, weight.shape)
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    x = x.reshape(k).contiguous()
    out = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    if residual is not None:
        assert residual.numel() == n and residual.dtype == x.dtype, (residual.shape, residual.dtype)
        residual = residual.reshape(n).contiguous()
    if norm_weight is not None:
        assert norm_weight.shape == (k,), norm_weight.shape
    block_k = min(1024, triton.next_power_of_2(k))
    # Two rows a program, one for long rows (down_proj's 14336) and for gated (two already):
    # tuned over the Llama-8B and SmolLM2 layer shapes, where no other tile configuration
    # did clearly better
    block_n = 1 if gated or k >= 8192 else 2
    if scale is not None:  # fp8 rows are half the bytes: twice the rows keep as many in flight
        block_n, block_k = 2 if gated else 4, min(1024, triton.next_power_of_2(k))
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, scale if scale is not None else x, out, residual if residual is not None else out,
        norm_weight if norm_weight is not None else x, n, k, weight.stride(0), weight.stride(1),
        scale.stride(0) if scale is not None else 0, group, eps,
        NORM=norm_weight is not None, RES=residual is not None, GATED=gated, HALF=x.dtype in _HALF,
        SCALED=scale is not None, GROUPED=group < k,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=4, **pdl_flags(x.device))
    return out

