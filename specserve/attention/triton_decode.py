"""Decode attention: one query token per request against its KV, read through req_to_token.

A program owns (request b, kv head, split): the GROUP query heads that share that kv head
are one [BLOCK_H, D] block, so each K/V block is loaded once per kv head (GQA). Key
positions [0, seq_len) are cut into NUM_SPLITS contiguous chunks (flash-decoding): with
one split the kernel writes the normalised output directly; with more, each split writes
its normalised partial output and log-sum-exp, and the last of a (request, kv head)'s
splits to finish merges them (`split_merge.py`), so a layer's attention is one launch. Splits
are whole key blocks, so a short sequence leaves the last ones empty: those programs
write a log-sum-exp of -inf and return at once (at a few hundred keys most splits are
empty, and any work in them would be paid in every layer of every step). Lengths
are read from a device `seq_lens` tensor, so one compiled kernel serves every length and
the launch grid depends only on (batch, kv heads, splits): safe to capture in a CUDA graph.

Tree drafting adds a *tail*: row b reads positions [0, tail_start[b]) through its table
row and positions [tail_start[b], seq_len[b]) from tail[b, :] (a branch's draft-tree
ancestors, then the node itself), so branches of one request share the prefix without
copying table rows (HAS_TAIL; one compiled variant more).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention import split_merge
from specserve.attention.split_merge import count_in
from specserve.attention.triton_kernels import (
    LOG2E,
    block_d,
    compute_dtype,
    dot_precision,
    load_kv_block,
    online_softmax_step,
    with_new_keys,
)
from specserve.cache.kv_pool import is_fp8
from specserve.kernels import pdl_flags
from specserve.kernels.pdl import wait_and_release

BLOCK_N = 64  # keys per loop step
MAX_SPLITS = 16


@triton.jit
def _slots(table, tail, n0, end, tail_start, BLOCK_N: tl.constexpr, HAS_TAIL: tl.constexpr):
    """The KV slots of keys n0 + [0, BLOCK_N) (0 past `end`): through the table row before
    `tail_start`, from the tail row from there on."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    valid = offs_n < end
    slots = tl.load(table + offs_n, mask=valid & (offs_n < tail_start), other=0)
    if HAS_TAIL:
        in_tail = valid & (offs_n >= tail_start)
        tail_slots = tl.load(tail + (offs_n - tail_start), mask=in_tail, other=0)
        slots = tl.where(in_tail, tail_slots, slots)
    return slots


@triton.jit
def _decode_kernel(Q, K, V, ReqToToken, ReqRows, SeqLens, Tail, TailStart, tail_len, Out, Lse, Final, Counts, qk_scale,
                   v_scale, stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tr, stride_tail,
                   stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_fb, stride_fh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   BLOCK_S: tl.constexpr,
                   STORE_LSE: tl.constexpr, FUSED: tl.constexpr, PREC: tl.constexpr, HAS_TAIL: tl.constexpr,
                   KV_FP8: tl.constexpr, USE_PDL: tl.constexpr):
    """Out/Lse: the splits' partial outputs and lse (STORE_LSE), or the output itself (one
    split). FUSED: the last split merges them into Final (`split_merge.count_in`)."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if HAS_TAIL:  # the table's keys, then the tail's tail_len
        tail_start = tl.load(TailStart + b).to(tl.int32)
        seq_len = tail_start + tail_len
    else:
        seq_len = tl.load(SeqLens + b)
        tail_start = seq_len  # every key comes through the table row
    row = tl.load(ReqRows + b)
    # Splits are whole key blocks; short sequences leave the last splits empty.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GROUP
    heads = kvh * GROUP + offs_h  # the query heads of this kv head
    if start >= end:  # an empty split writes lse = -inf only (the merge reads no o of it)
        if STORE_LSE:
            wait_and_release(USE_PDL)
            tl.store(Lse + b * stride_lb + heads * stride_lh + split, float("-inf"), mask=mask_h)
            if FUSED:
                count_in(Out + b * stride_ob + heads * stride_oh, Lse + b * stride_lb + heads * stride_lh,
                         Final + b * stride_fb + heads * stride_fh, mask_h, Counts + b * tl.num_programs(1) + kvh,
                         stride_os, NUM_SPLITS, BLOCK_S, HEAD_DIM, BLOCK_D)
        return
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    table = ReqToToken + row * stride_tr
    # Everything above, and the first key block's keys but the new token's, are no output
    # of the kernel just before (RoPE + KV write: q and the new token's K/V), so with PDL
    # they are fetched while it finishes; the new token's key is read after the wait
    slots = _slots(table, Tail + b * stride_tail, start, end, tail_start, BLOCK_N, HAS_TAIL)
    old = (start + tl.arange(0, BLOCK_N) < end) & (start + tl.arange(0, BLOCK_N) < seq_len - 1)
    k = load_kv_block(K, slots, old, stride_ks, kvh * stride_kh, offs_d, mask_d)
    v = load_kv_block(V, slots, old, stride_vs, kvh * stride_vh, offs_d, mask_d)
    wait_and_release(USE_PDL)
    q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    if not KV_FP8:  # else the products run in q's dtype (an fp8 pool's blocks are upcast)
        q = q.to(K.dtype.element_ty)

    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    k, v = with_new_keys(K, V, k, v, slots, start, end, seq_len - 1, kvh, stride_ks, stride_kh, stride_vs,
                         stride_vh, offs_d, mask_d, BLOCK_N)
    valid = start + tl.arange(0, BLOCK_N) < end
    acc, m_i, l_i = online_softmax_step(q, k, v, valid[None, :], acc, m_i, l_i, qk_scale, PREC)
    for n0 in range(start + BLOCK_N, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        slots = _slots(table, Tail + b * stride_tail, n0, end, tail_start, BLOCK_N, HAS_TAIL)
        k = load_kv_block(K, slots, valid, stride_ks, kvh * stride_kh, offs_d, mask_d)
        v = load_kv_block(V, slots, valid, stride_vs, kvh * stride_vh, offs_d, mask_d)
        acc, m_i, l_i = online_softmax_step(q, k, v, valid[None, :], acc, m_i, l_i, qk_scale, PREC)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if KV_FP8:
        o = o * v_scale
    out = Out + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(out, o.to(Out.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
    if STORE_LSE:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(Lse + b * stride_lb + heads * stride_lh + split, lse, mask=mask_h)
        if FUSED:
            count_in(Out + b * stride_ob + heads * stride_oh, Lse + b * stride_lb + heads * stride_lh,
                     Final + b * stride_fb + heads * stride_fh, mask_h, Counts + b * tl.num_programs(1) + kvh,
                     stride_os, NUM_SPLITS, BLOCK_S, HEAD_DIM, BLOCK_D)


def decode_warps(dim: int, dtype: torch.dtype) -> int:
    """Warps a decode program runs on: 8 for half-precision heads of 128 dims and more, whose
    [BLOCK_H, D] accumulator and K/V blocks spill on 4 (about 1.5 KB a thread at 128), else 4."""
    return 8 if dim >= 128 and dtype in (torch.float16, torch.bfloat16) else 4


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor,
                     req_to_token: torch.Tensor, req_rows: torch.Tensor, seq_lens: torch.Tensor | None,
                     scale: float, num_splits: int, tail: torch.Tensor | None = None,
                     tail_start: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """out[b] = attention of q[b] over slots req_to_token[req_rows[b], :seq_lens[b]], or
    with a tail, over req_to_token[req_rows[b], :tail_start[b]] ++ tail[b, :W] (seq_lens
    unused: the kernel adds W to tail_start itself, which spares a tree pass two launches
    a depth for the cast and the sum).

    q, out [B, H, D] (last dim contiguous); k_pool, v_pool [slots, kvH, D]; req_rows [B]
    int64, seq_lens [B] int32, tail_start [B] int32 or int64, tail [B, W] int64, all on
    q's device. Launches without reading any device value. k_scale, v_scale: an fp8
    pool's (stored = x / scale; cache/kv_pool.py).
    """
    bsz, heads, dim = q.shape
    group = heads // k_pool.shape[1]
    assert req_to_token.stride(1) == 1 and 1 <= num_splits <= MAX_SPLITS
    has_tail = tail is not None
    if tail is not None:
        assert tail.stride(1) == 1 and tail_start is not None
        seq_lens = tail_start  # never dereferenced
    else:
        assert seq_lens is not None
    bd = block_d(dim)
    dst_strides: tuple[int, ...]
    lse_strides: tuple[int, ...]
    if num_splits == 1:  # write the final output directly; Lse is never dereferenced
        dst, lse, dst_strides, lse_strides = out, seq_lens, (out.stride(0), out.stride(1), 0), (0, 0)
    else:  # per call, not per forward: inside a graph capture they come from the graph's pool
        dst = torch.empty(bsz, heads, num_splits, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(bsz, heads, num_splits, dtype=torch.float32, device=q.device)
        dst_strides, lse_strides = dst.stride()[:3], lse.stride()[:2]
    fused = split_merge.fused(num_splits, bsz * k_pool.shape[1])
    _decode_kernel[(bsz, k_pool.shape[1], num_splits)](
        q, k_pool, v_pool, req_to_token, req_rows, seq_lens, tail if has_tail else req_rows,
        tail_start if has_tail else seq_lens, tail.shape[1] if tail is not None else 0, dst, lse, out,
        split_merge.split_counts(q.device) if fused else seq_lens, scale * LOG2E * k_scale, v_scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        req_to_token.stride(0), tail.stride(0) if tail is not None else 0, *dst_strides, *lse_strides,
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=dim, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N,
        BLOCK_D=bd, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
        STORE_LSE=num_splits > 1, FUSED=fused,
        PREC=dot_precision(compute_dtype(q, k_pool)), HAS_TAIL=has_tail, KV_FP8=is_fp8(k_pool.dtype),
        num_warps=decode_warps(dim, q.dtype), num_stages=2, **pdl_flags(q.device))
    if num_splits > 1 and not fused:
        split_merge.reduce_splits(dst, lse, out, num_splits)
