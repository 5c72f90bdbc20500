"""Short-extend attention: a few new tokens per request (a verify tree, a draft extend)
against a long cached prefix, split over the keys like decode.

The extend kernel gives a program one query head and a block of at least 16 new tokens,
so a verify of 8 tree tokens over a few hundred cached keys is B * H programs, each
walking the whole prefix alone and loading every K/V block once per query head: at
batch 1 that is a handful of programs (SmolLM2: 9) on a GPU of over a hundred SMs, bound
by one program's latency and many times slower than a decode step's split attention.

Here a program owns (request b, row block, kv head, split): the request's rows are its
n_b new tokens times the GROUP query heads that share the kv head (row r = token
r // GROUP, head r % GROUP), cut into blocks of at most MAX_ROWS (32 in float32: `tiles`),
so each K/V block is loaded once per (kv head, row block), and the keys [0, prefix_b + n_b)
are cut into NUM_SPLITS chunks (flash-decoding) whose partial outputs and log-sum-exps
the last split of a (request, row block, kv head) to finish merges (`split_merge.py`).
Key j < prefix_b is visible to every row; new key j = prefix_b + m to row (token i) iff
mask[i, m] (the request's tree mask, from one flat uint8 buffer at mask_indptr[b]) or,
without a mask, m <= i (causal). K/V are read through req_to_token (the new tokens'
slots are already in the table). The split count depends
only on (batch size, kv heads) and the row-block count only on max_extend and the dtype,
so capture and replay launch the same grid. Without a custom mask (causal) a row block
stops at its last token's key: the keys after it are visible to none of its rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention import split_merge
from specserve.attention.split_merge import count_in
from specserve.attention.triton_decode import MAX_SPLITS
from specserve.attention.triton_kernels import (
    LOG2E,
    block_d,
    compute_dtype,
    dot_precision,
    load_kv_block,
    online_softmax_step,
    prefix_block,
    with_new_keys,
)
from specserve.cache.kv_pool import is_fp8
from specserve.kernels import pdl_flags
from specserve.kernels.pdl import wait_and_release

MAX_ROWS = 64  # rows (new tokens * GROUP) per program
FP32_ROWS = 32  # float32's: its tiles take twice the registers (`tiles`)
MAX_TOTAL_ROWS = 256  # per (request, kv head): a 64-node tree at GROUP 4; longer extends use the extend kernel


def fits(max_extend: int, group: int) -> bool:
    """Whether extends of up to `max_extend` new tokens per request run here."""
    return max_extend * group <= MAX_TOTAL_ROWS


def row_blocks(max_extend: int, group: int, max_rows: int = MAX_ROWS) -> tuple[int, int]:
    """(rows per program, row blocks per request) for extends of up to `max_extend` tokens."""
    rows = max_extend * group
    block = min(max_rows, max(16, triton.next_power_of_2(rows)))
    return block, triton.cdiv(rows, block)


def tiles(dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(most rows a program, keys a block, warps) for products in `dtype`. Half tiles hold
    64 rows and 64 keys (32 past 256 bytes a key row). float32's IEEE products run on FMA
    units and hold every tile in fp32: at 64 x 64 the compiler keeps a few registers and
    spills the rest of the tiles to local memory, many times slower than the half
    kernel, so float32 takes 32 x 32 tiles, on 8 warps past 64 dims, which fit."""
    if dtype == torch.float32:
        return FP32_ROWS, 32, 4 if block_d(dim) <= 64 else 8
    return MAX_ROWS, 64 if dim * dtype.itemsize <= 256 else 32, 4


@triton.jit
def _visible(n0, end, prefix, n_new, tok, mask_r, mask_base, BLOCK_N: tl.constexpr, CUSTOM_MASK: tl.constexpr):
    """[BLOCK_R, BLOCK_N] which of keys n0 + [0, BLOCK_N) each row sees: the prefix (and
    nothing past `end`), and among the new keys its tree mask's or the causal ones."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    valid = offs_n < end
    m = offs_n - prefix  # index among the new tokens; < 0 in the prefix
    if CUSTOM_MASK:
        is_new = valid & (m >= 0)
        bits = tl.load(mask_base + tok[:, None] * n_new + m[None, :],
                       mask=mask_r[:, None] & is_new[None, :], other=0)
        visible = valid[None, :] & ((m < 0)[None, :] | (bits != 0))
    else:
        visible = valid[None, :] & (m[None, :] <= tok[:, None])
    return visible


@triton.jit
def _short_kernel(Q, K, V, ReqToToken, ReqRows, PrefixLens, ExtendLens, QStarts, Mask, MaskIndptr,
                  Out, Lse, Final, Counts, qk_scale, v_scale,
                  stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tr,
                  stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_ft, stride_fh,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                  NUM_RB: tl.constexpr,
                  STORE_LSE: tl.constexpr, FUSED: tl.constexpr, CUSTOM_MASK: tl.constexpr, PREC: tl.constexpr,
                  KV_FP8: tl.constexpr, USE_PDL: tl.constexpr):
    """Out/Lse: the splits' partial outputs and lse (STORE_LSE), or the output itself (one
    split). FUSED: the last split of the program's rows merges them into Final."""
    b = tl.program_id(0) // NUM_RB
    rb = tl.program_id(0) % NUM_RB
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    prefix = tl.load(PrefixLens + b)
    n_new = tl.load(ExtendLens + b)
    q_start = tl.load(QStarts + b).to(tl.int64)
    row = tl.load(ReqRows + b)
    seq_len = prefix + n_new
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if not CUSTOM_MASK:  # causal: no row of this block sees past its last token
        end = tl.minimum(end, prefix + ((rb + 1) * BLOCK_R - 1) // GROUP + 1)

    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    tok = offs_r // GROUP  # the row's new token (query index within the request)
    heads = kvh * GROUP + offs_r % GROUP
    mask_r = tok < n_new
    t_rows = q_start + tok
    if start >= end:  # no key here (short sequences leave the last splits empty): lse -inf only
        if STORE_LSE:
            wait_and_release(USE_PDL)
            tl.store(Lse + t_rows * stride_lt + heads * stride_lh + split, float("-inf"), mask=mask_r)
            if FUSED:
                count_in(Out + t_rows * stride_ot + heads * stride_oh, Lse + t_rows * stride_lt + heads * stride_lh,
                         Final + t_rows * stride_ft + heads * stride_fh, mask_r,
                         Counts + tl.program_id(0) * tl.num_programs(1) + kvh, stride_os, NUM_SPLITS, BLOCK_S,
                         HEAD_DIM, BLOCK_D)
        return
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    table = ReqToToken + row * stride_tr
    # Everything above and the first key block's prefix part are no output of the kernel
    # just before (RoPE + KV write: q and the new tokens' K/V), so with PDL they are
    # fetched while it finishes; the new keys are read after the wait
    k_pre, v_pre, slots = prefix_block(K, V, table, start, end, prefix, kvh, stride_ks, stride_kh,
                                       stride_vs, stride_vh, offs_d, mask_d, BLOCK_N)
    wait_and_release(USE_PDL)
    q = tl.load(Q + t_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_r[:, None] & mask_d[None, :], other=0.0)
    if not KV_FP8:  # else the products run in q's dtype (an fp8 pool's blocks are upcast)
        q = q.to(K.dtype.element_ty)

    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    mask_base = Mask
    if CUSTOM_MASK:
        mask_base = Mask + tl.load(MaskIndptr + b)
    k, v = with_new_keys(K, V, k_pre, v_pre, slots, start, end, prefix, kvh, stride_ks, stride_kh,
                         stride_vs, stride_vh, offs_d, mask_d, BLOCK_N)
    visible = _visible(start, end, prefix, n_new, tok, mask_r, mask_base, BLOCK_N, CUSTOM_MASK)
    acc, m_i, l_i = online_softmax_step(q, k, v, visible, acc, m_i, l_i, qk_scale, PREC)
    for n0 in range(start + BLOCK_N, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        slots = tl.load(table + offs_n, mask=valid, other=0)
        k = load_kv_block(K, slots, valid, stride_ks, kvh * stride_kh, offs_d, mask_d)
        v = load_kv_block(V, slots, valid, stride_vs, kvh * stride_vh, offs_d, mask_d)
        visible = _visible(n0, end, prefix, n_new, tok, mask_r, mask_base, BLOCK_N, CUSTOM_MASK)
        acc, m_i, l_i = online_softmax_step(q, k, v, visible, acc, m_i, l_i, qk_scale, PREC)

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # rows that see no key here: o = 0, lse = -inf
    o = acc / l_safe[:, None]
    if KV_FP8:
        o = o * v_scale
    store = mask_r[:, None] & mask_d[None, :]
    out = Out + t_rows[:, None] * stride_ot + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(out, o.to(Out.dtype.element_ty), mask=store)
    if STORE_LSE:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(Lse + t_rows * stride_lt + heads * stride_lh + split, lse, mask=mask_r)
        if FUSED:
            count_in(Out + t_rows * stride_ot + heads * stride_oh, Lse + t_rows * stride_lt + heads * stride_lh,
                     Final + t_rows * stride_ft + heads * stride_fh, mask_r,
                     Counts + tl.program_id(0) * tl.num_programs(1) + kvh, stride_os, NUM_SPLITS, BLOCK_S,
                     HEAD_DIM, BLOCK_D)


def short_extend_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor,
                           req_to_token: torch.Tensor, req_rows: torch.Tensor, prefix_lens: torch.Tensor,
                           extend_lens: torch.Tensor, q_starts: torch.Tensor, max_extend: int, scale: float,
                           num_splits: int, mask: torch.Tensor | None = None,
                           mask_indptr: torch.Tensor | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> None:
    """`triton_extend.extend_attention`'s contract for extends with fits(max_extend, group),
    split `num_splits` ways over the keys (every row sees its own token, so the split
    holding key 0 of each row's visible set is never empty). k_scale, v_scale: an fp8 pool's."""
    total, heads, dim = q.shape
    group = heads // k_pool.shape[1]
    assert req_to_token.stride(1) == 1 and 1 <= num_splits <= MAX_SPLITS and fits(max_extend, group)
    bd = block_d(dim)
    dst_strides: tuple[int, ...]
    lse_strides: tuple[int, ...]
    if num_splits == 1:  # write the final output directly; Lse is never dereferenced
        dst, lse, dst_strides, lse_strides = out, extend_lens, (out.stride(0), out.stride(1), 0), (0, 0)
    else:
        dst = torch.empty(total, heads, num_splits, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(total, heads, num_splits, dtype=torch.float32, device=q.device)
        dst_strides, lse_strides = dst.stride()[:3], lse.stride()[:2]
    custom = mask is not None
    if not custom:  # never dereferenced: the CUSTOM_MASK branches are compiled out
        mask, mask_indptr = extend_lens, extend_lens
    cdt = compute_dtype(q, k_pool)
    max_rows, block_n, warps = tiles(dim, cdt)
    block_r, num_rb = row_blocks(max_extend, group, max_rows)
    grid = (len(req_rows) * num_rb, k_pool.shape[1], num_splits)
    fused = split_merge.fused(num_splits, grid[0] * grid[1])
    _short_kernel[grid](
        q, k_pool, v_pool, req_to_token, req_rows, prefix_lens, extend_lens, q_starts, mask, mask_indptr,
        dst, lse, out, split_merge.split_counts(q.device) if fused else extend_lens, scale * LOG2E * k_scale, v_scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        req_to_token.stride(0), *dst_strides, *lse_strides, out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=dim, BLOCK_R=block_r,
        BLOCK_N=block_n, BLOCK_D=bd, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
        NUM_RB=num_rb, STORE_LSE=num_splits > 1, FUSED=fused,
        CUSTOM_MASK=custom, PREC=dot_precision(cdt), KV_FP8=is_fp8(k_pool.dtype),
        num_warps=warps, num_stages=2, **pdl_flags(q.device))
    if num_splits > 1 and not fused:
        split_merge.reduce_splits(dst, lse, out, num_splits)
