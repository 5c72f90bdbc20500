"""Triton building blocks shared by the decode and extend attention kernels.

Owns the per-key-block step of flash attention (online softmax in base 2) and the gather
of one K or V block through token slots. Knows nothing about requests or forward modes;
`triton_decode.py` and `triton_extend.py` own the kernels, `triton_backend.py` the launches.

An fp8 pool (cache/kv_pool.py) is read as stored: `online_softmax_step` upcasts each block
to the queries' dtype for its products (exact), and the kernels (KV_FP8) fold the K scale
into the softmax scale and multiply their output by the V scale.

Importing this file imports triton, and `@triton.jit` reads TRITON_INTERPRET when it runs:
set it before the first import to run the kernels on CPU tensors. Only APIs of triton 3.6.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.cache.kv_pool import is_fp8

LOG2E = 1.4426950408889634  # scores are kept in log2 units so the kernels use exp2


@triton.jit
def load_kv_block(pool, slots, valid, stride_slot, head_offset, offs_d, mask_d):
    """[BLOCK_N, BLOCK_D] rows `slots` of one kv head of a [slots, kvH, D] pool; 0 where masked."""
    ptrs = pool + slots[:, None] * stride_slot + head_offset + offs_d[None, :]
    return tl.load(ptrs, mask=valid[:, None] & mask_d[None, :], other=0.0)


@triton.jit
def prefix_block(K, V, table, start, end, old_end, kvh, stride_ks, stride_kh, stride_vs, stride_vh,
                 offs_d, mask_d, BLOCK_N: tl.constexpr):
    """The first key block [start, start + BLOCK_N) of a split: its slots (through a table
    row) and the K/V of its keys before `old_end`, which no kernel of this forward writes
    (zeros elsewhere). Called before a PDL wait; `with_new_keys` completes the block after it."""
    offs_n = start + tl.arange(0, BLOCK_N)
    valid = offs_n < end
    slots = tl.load(table + offs_n, mask=valid, other=0)
    old = valid & (offs_n < old_end)
    k = load_kv_block(K, slots, old, stride_ks, kvh * stride_kh, offs_d, mask_d)
    v = load_kv_block(V, slots, old, stride_vs, kvh * stride_vh, offs_d, mask_d)
    return k, v, slots


@triton.jit
def with_new_keys(K, V, k, v, slots, start, end, old_end, kvh, stride_ks, stride_kh, stride_vs, stride_vh,
                  offs_d, mask_d, BLOCK_N: tl.constexpr):
    """`prefix_block`'s K/V with the keys at or after `old_end` (written by the kernel just
    before: read only after the PDL wait) filled in."""
    offs_n = start + tl.arange(0, BLOCK_N)
    new = (offs_n < end) & (offs_n >= old_end)
    k = tl.where(new[:, None], load_kv_block(K, slots, new, stride_ks, kvh * stride_kh, offs_d, mask_d), k)
    v = tl.where(new[:, None], load_kv_block(V, slots, new, stride_vs, kvh * stride_vh, offs_d, mask_d), v)
    return k, v


@triton.jit
def online_softmax_step(q, k, v, visible, acc, m_i, l_i, qk_scale, PREC: tl.constexpr):
    """Fold one key block into the running (acc, m_i, l_i) of a block of query rows.

    q [M, D], k/v [N, D], visible [M, N] (or broadcastable) bool; acc [M, D] fp32 holds
    sum_j 2^(s_j - m_i) v_j, l_i [M] the same sum of weights, m_i [M] the running max of
    s = q.k * scale * log2(e). A row that has seen no visible key keeps m_i = -inf and
    l_i = 0 (the max is taken as 0 for it, so no -inf - -inf = NaN appears).
    """
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC) * qk_scale  # no-op casts but from fp8
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PREC)
    return acc, m_new, l_i


def compute_dtype(q: torch.Tensor, k_pool: torch.Tensor) -> torch.dtype:
    """The dtype of the kernels' products: the pool's, or beside an fp8 pool the queries'."""
    return q.dtype if is_fp8(k_pool.dtype) else k_pool.dtype


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 models get exact fp32 products (the default would be TF32 on tensor cores)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def block_d(head_dim: int) -> int:
    """The head dim padded to a power of two (tl.dot needs at least 16)."""
    return max(16, triton.next_power_of_2(head_dim))
