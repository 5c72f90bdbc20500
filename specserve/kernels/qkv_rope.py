"""An attention layer's fused qkv projection for a few tokens, with RoPE and the KV-cache
write in the same launch: `skinny.skinny` then `rope.rope_store_kv`, as one kernel.

Apart, a verify or draft forward of 2-32 tokens runs the projection (skinny.py) and then a
launch of its own that rotates q and k and stores k and v (rope.py): one more launch per
layer in a step that is bound by launches. Rotate-half pairs dim d of a head with dim
d + D/2, so a program here takes the 16 weight rows of 8 such pairs, interleaved (row 2p
is dim d0 + p, row 2p + 1 its partner d0 + p + D/2): after the dot the pairs are adjacent
columns of [tokens, 16], which `tl.split` separates and `tl.join` puts back. A head of 64
dims is 4 programs, the same 16 rows a program as the plain kernel's, so the grid is the
plain kernel's.

Rounding is that of the two launches it replaces: the product rounded to x's dtype (the
qkv tensor), each RoPE product and their sum rounded to the queries' dtype (rope.py's
`_rotated`), then keys and values to the cache's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from specserve.cache.kv_pool import inverse_scale, is_fp8
from specserve.core.quant import QuantWeight
from specserve.kernels import SKINNY_MAX_TOKENS, pdl_flags
from specserve.kernels.matvec import unpack
from specserve.kernels.pdl import wait_and_release
from specserve.kernels.rope import to_cache
from specserve.kernels.skinny import (
    _config,
    deferred_norm,
    first_tiles,
    product,
    product_flags,
    row_scaled,
    scale_mode,
    split_buffers,
    split_range,
    split_sum,
    tile_bytes,
)

if TYPE_CHECKING:
    from specserve.core.rope import RopeAt

PAIRS = 8  # rotation pairs a program owns: 16 weight rows, tl.dot's least


def supports(head_dim: int) -> bool:
    """Whether heads of `head_dim` split into programs of PAIRS rotation pairs."""
    return head_dim % (2 * PAIRS) == 0


@triton.jit
def _tables(table_ptr, pos_ptr, toks, tmask, st, d0, D: tl.constexpr, PAIRS: tl.constexpr):
    """(cos, sin) [BLOCK_T, PAIRS] at dims d0 + p, then at their partners d0 + p + D/2, fp32,
    from the rows of table [positions, 2D] (cos, then signed sin) at the tokens' positions."""
    da = (d0 + tl.arange(0, PAIRS))[None, :]
    pos = tl.load(pos_ptr + toks, mask=tmask, other=0)
    offs, m = table_ptr + pos[:, None] * st, tmask[:, None]
    ca = tl.load(offs + da, mask=m, other=0.0).to(tl.float32)
    sa = tl.load(offs + D + da, mask=m, other=0.0).to(tl.float32)
    cb = tl.load(offs + da + D // 2, mask=m, other=0.0).to(tl.float32)
    sb = tl.load(offs + D + da + D // 2, mask=m, other=0.0).to(tl.float32)
    return ca, sa, cb, sb


@triton.jit
def _rotate(y, ca, sa, cb, sb, DTYPE: tl.constexpr, BLOCK_T: tl.constexpr, PAIRS: tl.constexpr):
    """y [BLOCK_T, 2 PAIRS] fp32, columns interleaved (dim d0 + p, its partner d0 + p + D/2),
    rotated: out[d] = x[d] cos[d] + x[d +- D/2] sin[d] (signed sin, `_tables`), each
    product and the sum rounded to DTYPE as rope.py's `_rotated` rounds them."""
    a, b = tl.split(tl.reshape(y, [BLOCK_T, PAIRS, 2]))
    ra = ((a * ca).to(DTYPE).to(tl.float32) + (b * sa).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
    rb = ((b * cb).to(DTYPE).to(tl.float32) + (a * sb).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
    return tl.reshape(tl.join(ra, rb), [BLOCK_T, 2 * PAIRS])


@triton.jit
def _qkv_rope_kernel(x_ptr, w_ptr, s_ptr, nw_ptr, table_ptr, pos_ptr, q_ptr, k_cache, v_cache, slots_ptr, part_ptr,
                     count_ptr, T, K, H, KVH, sx, sw, swk, ss, GROUP, st, sk0, sk1, sv0, sv1, eps, k_inv, v_inv,
                     SCALES: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr, DEFER: tl.constexpr, HALF: tl.constexpr,
                     F32: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr,
                     SPLIT_K: tl.constexpr, PAIRS: tl.constexpr, KV_FP8: tl.constexpr, USE_PDL: tl.constexpr):
    per_head: tl.constexpr = D // (2 * PAIRS)
    head = tl.program_id(0) // per_head  # H query heads, then KVH keys, then KVH values
    d0 = (tl.program_id(0) % per_head) * PAIRS
    i = tl.arange(0, 2 * PAIRS)
    d = d0 + i // 2 + (i % 2) * (D // 2)  # this program's dims, interleaved in pairs
    rows = head * D + d
    n = (H + 2 * KVH) * D
    k_lo, k_len = split_range(K, SPLIT_K, BLOCK_K)  # the whole K without a split
    xk, wk, nwk = x_ptr + k_lo, w_ptr + k_lo * swk, nw_ptr + k_lo
    w, wu, g = first_tiles(wk, nwk, rows, rows < n, n, k_len, sw, swk, w_ptr, k_lo, NORM, False, BLOCK_K, False)
    wait_and_release(USE_PDL)  # past this, every earlier kernel's writes (x, the tables) are visible
    toks = tl.arange(0, BLOCK_T)
    tmask = toks < T
    ca, sa, cb, sb = _tables(table_ptr, pos_ptr, toks, tmask, st, d0, D, PAIRS)  # on their way during the dot
    acc, _, sq = product(xk, wk, nwk, w, wu, g, rows, rows < n, T, n, k_len, sx, sw, swk, eps, w_ptr, k_lo, s_ptr, ss,
                         GROUP, NORM, DEFER, False, HALF, F32, BLOCK_T, 2 * PAIRS, BLOCK_K, ONE_TILE, False, SCALES)
    last = True
    if SPLIT_K > 1:
        tl.static_assert(DEFER or not NORM)  # the exact norm needs the whole row in one program
        acc, _, sq, last = split_sum(part_ptr, count_ptr, acc, acc, sq, False, NORM, SPLIT_K, 2 * PAIRS, BLOCK_T)
    if last:
        acc, _ = deferred_norm(acc, acc, sq, K, eps, NORM, DEFER)
        acc, _ = row_scaled(acc, acc, s_ptr, rows, rows < n, n, ss, False, SCALES)
        _rope_store(acc, q_ptr, k_cache, v_cache, slots_ptr, ca, sa, cb, sb, head, d, T, H, KVH, sk0, sk1, sv0, sv1,
                    k_inv, v_inv, x_ptr.dtype.element_ty, D, BLOCK_T, PAIRS, KV_FP8)


@triton.jit
def _rope_store(acc, q_ptr, k_cache, v_cache, slots_ptr, ca, sa, cb, sb, head, d, T, H, KVH, sk0, sk1, sv0, sv1,
                k_inv, v_inv, DTYPE: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, PAIRS: tl.constexpr,
                KV_FP8: tl.constexpr):
    """The projection acc [2 PAIRS, BLOCK_T] rounded to the activations' DTYPE, rotated
    (queries and keys) and stored: queries to q_ptr, keys and values at their slots (an
    fp8 cache's times k_inv / v_inv, the reciprocals of its scales: rope.py `to_cache`)."""
    toks = tl.arange(0, BLOCK_T)
    tmask = toks < T
    y = tl.trans(acc.to(DTYPE).to(tl.float32))  # [BLOCK_T, 2 PAIRS]: the qkv values
    if head < H + KVH:
        y = _rotate(y, ca, sa, cb, sb, q_ptr.dtype.element_ty, BLOCK_T, PAIRS)
    m = tmask[:, None]
    if head < H:
        tl.store(q_ptr + (toks[:, None] * H + head) * D + d[None, :], y.to(q_ptr.dtype.element_ty), mask=m)
    else:
        slot = tl.load(slots_ptr + toks, mask=tmask, other=0)[:, None]
        if head < H + KVH:
            tl.store(k_cache + slot * sk0 + (head - H) * sk1 + d[None, :], to_cache(y, k_cache, k_inv, KV_FP8),
                     mask=m)
        else:
            tl.store(v_cache + slot * sv0 + (head - H - KVH) * sv1 + d[None, :], to_cache(y, v_cache, v_inv, KV_FP8),
                     mask=m)


def qkv_rope_store(x: torch.Tensor, weight: torch.Tensor | QuantWeight, heads: int, rope: RopeAt,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, *,
                   norm_weight: torch.Tensor | None = None, eps: float = 0.0, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> torch.Tensor:
    """x [T, K] (T <= SKINNY_MAX_TOKENS) through the fused qkv weight [(heads + 2 kvH) D, K]
    (RMSNorm first when norm_weight is given) -> rotated queries [T, heads, D]; the rotated
    keys and the values stored at k_cache/v_cache[slots[t]] ([slots, kvH, D]; an fp8 cache
    divides them by k_scale / v_scale). The cos and
    signed sin of token t are rope.table's row rope.positions[t] (`RopeAt`: no gather).
    An fp8 weight is read as `skinny.skinny` reads it."""
    weight, scale, group = unpack(weight)
    t, k = x.shape
    kv_heads, dim = k_cache.shape[1:]
    assert 1 <= t <= SKINNY_MAX_TOKENS and supports(dim) and weight.shape == ((heads + 2 * kv_heads) * dim, k)
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1 and v_cache.shape[1:] == (kv_heads, dim)
    assert slots.shape == (t,) and (norm_weight is None or norm_weight.shape == (k,))
    table, positions = rope.table, rope.positions
    assert rope.head_dim == dim and table.shape[1] == 2 * dim and table.stride(1) == 1 and positions.shape == (t,)
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(t, heads, dim, dtype=torch.promote_types(x.dtype, table.dtype), device=x.device)
    norm, block_t = norm_weight is not None, 16 if t <= 16 else 32
    cfg = _config(weight.shape[0], k, False, norm, tile_bytes(x, weight), block_t, x.device)
    programs = (heads + 2 * kv_heads) * dim // (2 * PAIRS)
    cfg = cfg._replace(block_n=2 * PAIRS)  # this kernel's rows a program
    part, counts = split_buffers(x.device, programs, cfg, block_t)
    _qkv_rope_kernel[(programs, cfg.split)](
        x, weight, scale if scale is not None else x, norm_weight if norm else x, table, positions, q, k_cache,
        v_cache, slots, part, counts, t, k, heads, kv_heads, x.stride(0), weight.stride(0), weight.stride(1),
        scale.stride(0) if scale is not None else 0, group, table.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), eps,
        inverse_scale(k_scale), inverse_scale(v_scale), KV_FP8=is_fp8(k_cache.dtype),
        SCALES=scale_mode(scale, group, k), D=dim, PAIRS=PAIRS, SPLIT_K=cfg.split, num_warps=cfg.warps,
        num_stages=cfg.stages,
        **product_flags(x, norm, k, block_t, cfg.block_k, cfg.split), **pdl_flags(x.device))
    return q
