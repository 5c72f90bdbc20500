"""The deterministic mode's qkv projection with RoPE and the KV-cache write in its epilogue.

`invariant_mm.invariant_matmul` over an attention layer's fused qkv weight (input norm
folded in), then `rope.rope_store_kv`, as one launch: per layer one launch fewer on the
chain of dependent launches that a batch-1 step is. The rows' arithmetic is
invariant_mm.py's, whatever the row count (the same walkers, splits and sums), and the
epilogue is row-local, so a row's results are the same bits in any call.

A program's BLOCK_N output columns are PAIRS = BLOCK_N / 2 rotation pairs of one head,
interleaved as in qkv_rope.py (column 2p is dim d0 + p, column 2p + 1 its partner
d0 + p + D/2): a column's sums do not depend on which columns share its tile, and after
them each pair sits in adjacent columns, which qkv_rope's `_rotate` turns. Heads are
whole numbers of tiles (D a multiple of BLOCK_N, `fuses`).

Rounding is that of the two launches it replaces: the sums rounded to x's dtype (the qkv
tensor), each RoPE product and their sum to the queries' dtype, keys and values then to
the cache's (an fp8 cache's through `rope.to_cache`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from specserve.cache.kv_pool import inverse_scale, is_fp8
from specserve.kernels import pdl_flags
from specserve.kernels.invariant_mm import (
    BLOCK_M,
    _finished_sums,
    _one_split,
    _split_sum,
    _walk,
    _walk_splits,
    plan,
    split_parts,
)
from specserve.kernels.qkv_rope import _rotate, _tables
from specserve.kernels.rope import to_cache
from specserve.kernels.skinny_config import counts

if TYPE_CHECKING:
    from specserve.core.rope import RopeAt


@triton.jit
def _store_heads(y, rows, rmask, head, d, q_ptr, k_cache, v_cache, slots_ptr, H, KVH, sk0, sk1, sv0, sv1, k_inv,
                 v_inv, D: tl.constexpr, KV_FP8: tl.constexpr):
    """Rows' values y [BLOCK_M, BLOCK_N] of one head's dims d: a query's to q_ptr [M, H, D],
    a key's and a value's at the rows' slots of the cache."""
    m = rmask[:, None]
    if head < H:
        tl.store(q_ptr + (rows[:, None].to(tl.int64) * H + head) * D + d[None, :], y.to(q_ptr.dtype.element_ty), mask=m)
    else:
        slot = tl.load(slots_ptr + rows, mask=rmask, other=0).to(tl.int64)[:, None]
        if head < H + KVH:
            tl.store(k_cache + slot * sk0 + (head - H) * sk1 + d[None, :], to_cache(y, k_cache, k_inv, KV_FP8), mask=m)
        else:
            tl.store(v_cache + slot * sv0 + (head - H - KVH) * sv1 + d[None, :], to_cache(y, v_cache, v_inv, KV_FP8),
                     mask=m)


@triton.jit(do_not_specialize=["M", "zero"])
def _qkv_rope_kernel(x_ptr, w_ptr, b_ptr, ss_in, part_ptr, count_ptr, table_ptr, pos_ptr, q_ptr, k_cache, v_cache,
                     slots_ptr, M, K, H, KVH, sx, sw, swk, n_ss, eps, zero, st, sk0, sk1, sv0, sv1, k_inv, v_inv,
                     HAS_BIAS: tl.constexpr, NORM: tl.constexpr, S_IN: tl.constexpr, PREC: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                     SPLITS: tl.constexpr, D: tl.constexpr, KV_FP8: tl.constexpr, USE_PDL: tl.constexpr):
    PAIRS: tl.constexpr = BLOCK_N // 2
    per_head: tl.constexpr = D // BLOCK_N
    head = tl.program_id(1) // per_head  # H query heads, then KVH keys, then KVH values
    d0 = (tl.program_id(1) % per_head) * PAIRS
    i = tl.arange(0, BLOCK_N)
    d = d0 + i // 2 + (i % 2) * (D // 2)  # this program's dims, interleaved in pairs
    cols = head * D + d
    N = (H + 2 * KVH) * D
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask, nmask = rows < M, cols < N
    if SPLITS > 1:
        acc, _ = _one_split(x_ptr, w_ptr, w_ptr, rows, rmask, cols, nmask, N, K, sx, sw, swk, 0, PREC, 0, 1, False,
                            BLOCK_M, BLOCK_N, BLOCK_K, USE_PDL)
    elif SPLIT_K:
        acc, _ = _walk_splits(x_ptr, w_ptr, w_ptr, rows, rmask, cols, nmask, N, K, sx, sw, swk, 0, zero, PREC, 0, 1,
                              False, BLOCK_M, BLOCK_N, BLOCK_K, USE_PDL)
    else:
        acc, _ = _walk(x_ptr, w_ptr, w_ptr, rows, rmask, cols, nmask, N, K, sx, sw, swk, 0, PREC, 0, 1, False,
                       BLOCK_M, BLOCK_N, BLOCK_K, USE_PDL)
    last = True
    if SPLITS > 1:
        acc, _, last = _split_sum(part_ptr, count_ptr, acc, acc, rows, cols, rmask[:, None] & nmask[None, :], M, N,
                                  False, SPLITS)
    if last:
        acc, _ = _finished_sums(acc, acc, w_ptr, b_ptr, ss_in, rows, rmask, cols, nmask, N, K, 0, n_ss, eps, 0,
                                HAS_BIAS, NORM, S_IN, False)
        y = acc.to(x_ptr.dtype.element_ty).to(tl.float32)  # the qkv tensor's values
        if head < H + KVH:
            ca, sa, cb, sb = _tables(table_ptr, pos_ptr, rows, rmask, st, d0, D, PAIRS)
            y = _rotate(y, ca, sa, cb, sb, q_ptr.dtype.element_ty, BLOCK_M, PAIRS)
        _store_heads(y, rows, rmask, head, d, q_ptr, k_cache, v_cache, slots_ptr, H, KVH, sk0, sk1, sv0, sv1, k_inv,
                     v_inv, D, KV_FP8)


def fuses(weight: torch.Tensor, head_dim: int, rope: RopeAt) -> bool:
    """Whether `invariant_qkv_rope` serves this qkv weight [(H + 2 kvH) D, K]: heads of whole
    output tiles, a rotary table over the whole head."""
    return (head_dim % plan(1, weight.shape[0], weight.shape[1], None).block_n == 0 and rope.head_dim == head_dim
            and rope.table.shape[1] == 2 * head_dim and rope.table.stride(1) == 1)


def invariant_qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, heads: int, rope: RopeAt,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, *,
                       norm: tuple[float, torch.Tensor], k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """x [M, K] through the fused qkv weight [(heads + 2 kvH) D, K] (the input norm's weight
    folded in; `norm` is (eps, x's partial sums of squares), `invariant_matmul`'s) ->
    rotated queries [M, heads, D]; the rotated keys and the values stored at
    k_cache/v_cache[slots] ([slots, kvH, D]; an fp8 cache divides them by k_scale /
    v_scale). The cos and signed sin of row i are rope.table's row rope.positions[i]."""
    (m, k), (n, kw) = x.shape, weight.shape
    kv_heads, dim = k_cache.shape[1:]
    assert kw == k and n == (heads + 2 * kv_heads) * dim and fuses(weight, dim, rope), (x.shape, weight.shape)
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1 and v_cache.shape[1:] == (kv_heads, dim)
    assert slots.shape == (m,) and rope.positions.shape == (m,)
    eps, ss_in = norm
    assert ss_in.shape[0] == m and ss_in.is_contiguous(), ss_in.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty(m, heads, dim, dtype=torch.promote_types(x.dtype, rope.table.dtype), device=x.device)
    if m == 0:
        return q
    p = plan(m, n, k, None)
    _qkv_rope_kernel[(triton.cdiv(m, BLOCK_M), n // p.block_n, p.splits)](
        x, weight, bias if bias is not None else weight, ss_in, split_parts(p, m, n, x.device), counts(x.device),
        rope.table, rope.positions, q, k_cache, v_cache, slots, m, k, heads, kv_heads, x.stride(0), weight.stride(0),
        weight.stride(1), ss_in.shape[1], eps, 0.0, rope.table.stride(0), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), inverse_scale(k_scale), inverse_scale(v_scale),
        HAS_BIAS=bias is not None, NORM=True, S_IN=triton.next_power_of_2(ss_in.shape[1]),
        PREC="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=BLOCK_M, BLOCK_N=p.block_n, BLOCK_K=p.block_k,
        SPLIT_K=p.split, SPLITS=p.splits, D=dim, KV_FP8=is_fp8(k_cache.dtype), num_warps=p.warps,
        num_stages=p.stages, **pdl_flags(x.device))
    return q
