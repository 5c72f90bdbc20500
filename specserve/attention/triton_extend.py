"""Extend attention: ragged blocks of new queries against a cached prefix plus themselves.

A program owns (request b, query head h, block of BLOCK_M new tokens of b). Pass 1 runs
over the prefix keys [0, prefix_b) unmasked; pass 2 over the new keys
prefix_b + [0, n_b), masked causally (new key m visible to query i iff m <= i, and key
blocks past the query block are skipped) or by the request's custom mask, read from one
flat uint8 buffer at mask_indptr[b] + i * n_b + m. Both passes read K/V through
req_to_token (the new tokens' slots are already in the table and their K/V already in the
pool), so the result equals the reference backend's even when slots repeat in a batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.triton_kernels import (
    LOG2E,
    block_d,
    compute_dtype,
    dot_precision,
    load_kv_block,
    online_softmax_step,
)
from specserve.cache.kv_pool import is_fp8


@triton.jit
def _extend_kernel(Q, K, V, Out, ReqToToken, ReqRows, PrefixLens, ExtendLens, QStarts,
                   Mask, MaskIndptr, qk_scale, v_scale,
                   stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                   stride_ot, stride_oh, stride_tr,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CUSTOM_MASK: tl.constexpr,
                   PREC: tl.constexpr, KV_FP8: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    n_new = tl.load(ExtendLens + b)
    if m0 >= n_new:  # the grid is sized by the longest request
        return
    prefix = tl.load(PrefixLens + b)
    q_start = tl.load(QStarts + b).to(tl.int64)
    row = tl.load(ReqRows + b)
    kv_off_k = (h // GROUP) * stride_kh
    kv_off_v = (h // GROUP) * stride_vh

    offs_m = m0 + tl.arange(0, BLOCK_M)  # query index within the request's new tokens
    mask_m = offs_m < n_new
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_rows = q_start + offs_m
    q = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if not KV_FP8:  # else the products run in q's dtype (an fp8 pool's blocks are upcast)
        q = q.to(K.dtype.element_ty)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table = ReqToToken + row * stride_tr

    for n0 in range(0, prefix, BLOCK_N):  # pass 1: the cached prefix, visible to every query
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < prefix
        slots = tl.load(table + offs_n, mask=valid, other=0)
        k = load_kv_block(K, slots, valid, stride_ks, kv_off_k, offs_d, mask_d)
        v = load_kv_block(V, slots, valid, stride_vs, kv_off_v, offs_d, mask_d)
        acc, m_i, l_i = online_softmax_step(q, k, v, valid[None, :], acc, m_i, l_i, qk_scale, PREC)

    if CUSTOM_MASK:  # pass 2: the new tokens (m = index among them)
        hi = n_new
        mask_base = Mask + tl.load(MaskIndptr + b)
    else:
        hi = tl.minimum(n_new, m0 + BLOCK_M)  # later keys are in every query's future
    for j0 in range(0, hi, BLOCK_N):
        offs_j = j0 + tl.arange(0, BLOCK_N)
        valid = offs_j < n_new
        slots = tl.load(table + prefix + offs_j, mask=valid, other=0)
        k = load_kv_block(K, slots, valid, stride_ks, kv_off_k, offs_d, mask_d)
        v = load_kv_block(V, slots, valid, stride_vs, kv_off_v, offs_d, mask_d)
        if CUSTOM_MASK:
            bits = tl.load(mask_base + offs_m[:, None] * n_new + offs_j[None, :],
                           mask=mask_m[:, None] & valid[None, :], other=0)
            visible = bits != 0
        else:
            visible = (offs_j[None, :] <= offs_m[:, None]) & valid[None, :]
        acc, m_i, l_i = online_softmax_step(q, k, v, visible, acc, m_i, l_i, qk_scale, PREC)

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # a query that may see nothing gets 0, not NaN
    o = acc / l_safe[:, None]
    if KV_FP8:
        o = o * v_scale
    out = Out + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(out, o.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _blocks(max_extend: int, dim: int, elem_bytes: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): short extends (verify trees) use a small query block; wide rows
    (fp32, or head_dim > 128) smaller key blocks, to fit ~100 KB of shared memory (sm_86/89)."""
    block_m = min(64, max(16, triton.next_power_of_2(max_extend)))
    if dim * elem_bytes > 256:
        return min(block_m, 32), 32
    return block_m, 64


def extend_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor,
                     req_to_token: torch.Tensor, req_rows: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, q_starts: torch.Tensor, max_extend: int, scale: float,
                     mask: torch.Tensor | None = None, mask_indptr: torch.Tensor | None = None,
                     k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """out[T] = attention of the packed new tokens q [T, H, D] of B requests.

    prefix_lens / extend_lens / q_starts [B] int32, req_rows [B] int64, all on q's device;
    `max_extend` (host int) >= every extend_lens[b] sizes the grid. `mask`: flat uint8, the
    row-major [n_b, n_b] masks concatenated, request b's at mask_indptr[b] (int64); None =
    causal. k_pool, v_pool [slots, kvH, D]; out [T, H, D]. k_scale, v_scale: an fp8 pool's.
    """
    bsz, heads, dim = len(req_rows), q.shape[1], q.shape[2]
    assert req_to_token.stride(1) == 1
    cdt = compute_dtype(q, k_pool)
    block_m, block_n = _blocks(max_extend, dim, cdt.itemsize)
    custom = mask is not None
    if not custom:  # never dereferenced: the CUSTOM_MASK branches are compiled out
        mask, mask_indptr = extend_lens, extend_lens
    grid = (bsz, heads, triton.cdiv(max_extend, block_m))
    _extend_kernel[grid](
        q, k_pool, v_pool, out, req_to_token, req_rows, prefix_lens, extend_lens, q_starts,
        mask, mask_indptr, scale * LOG2E * k_scale, v_scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0),
        GROUP=heads // k_pool.shape[1], HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d(dim), CUSTOM_MASK=custom, PREC=dot_precision(cdt), KV_FP8=is_fp8(k_pool.dtype),
        num_warps=4 if dim <= 64 else 8, num_stages=2)
