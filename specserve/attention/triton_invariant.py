"""Batch-invariant attention for `--enable-deterministic-inference`: one arithmetic per query.

Invariant: a query's output depends only on its own vector and the keys it sees, in
position order, never on the forward mode, its batch neighbours or its request's other
queries. A token decoded alone, the same token as a node of a verified tree and as a row
of a prefill chunk get the same bits.

How: every query walks the *logical* sequence of the keys it may see, positions
0 .. L-1, the same list in every mode:
  * decode: the table row's first L = seq_len slots;
  * causal extend (prefill, a draft's extend): row slots 0 .. prefix + i;
  * tree verify: the row's `prefix` slots, then the query's visible tree nodes in node
    order (an ancestor precedes its descendants), compacted: masked nodes take no
    position, so a node at depth d sees the same L = prefix + d + 1 keys as its decode;
  * decode with a draft tail: row slots 0 .. tail_start - 1, then the tail's.
The walk is split into pieces of SPLIT(L) = max(BLOCK_N, next_pow2(ceil(L / S_CAP)))
positions (a function of L alone, at most S_CAP of them), each folded block by block of
BLOCK_N positions aligned at 0 (online softmax, as the other kernels); a second kernel
merges a query's pieces in order (unrolled to S_CAP, the pieces past its last left out by a
select, so that all their loads are issued at once). One program handles one query token, one kv head and
one piece, its group of query heads padded to 16 rows of tl.dot. The grid has a row per
request in a decode and a row per token row in an extend (each finds its request,
`_owner`): a (requests x longest extend) grid would launch, for a prefill graph whose
longest extend is its whole token bucket, about as many idle programs per real one as
the graph has requests.

Partial results live in [T, H, S_CAP, D] fp32 buffers allocated per forward (graph-safe:
CUDA-graph capture takes them from its pool). An fp8 pool is read as in the other
kernels: the K scale folds into the softmax scale, the V scale multiplies the output.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

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
from specserve.kernels import pdl_flags
from specserve.kernels.pdl import wait_and_release

if TYPE_CHECKING:
    from specserve.attention.triton_backend import TritonMeta

BLOCK_N = 32
S_CAP = 8  # pieces per query at most
BLOCK_B = 64  # requests an extend's token row searches at a time for its own (`_owner`)
DECODE, CAUSAL, TREE, TAIL = 0, 1, 2, 3  # MODE, as the host passes it; the kernels read these:
_DECODE, _CAUSAL, _TREE, _TAIL = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)


@triton.jit
def _owner(Extend, QStarts, t, nreq, BLOCK_B: tl.constexpr):
    """(request b, query i) of token row t in an extend of `nreq` requests: the b whose
    rows [q_start, q_start + extend) hold t (b = nreq when none does: a padding row)."""
    b, i = t * 0, t * 0
    for c in range(0, nreq, BLOCK_B):
        r = c + tl.arange(0, BLOCK_B)
        live = r < nreq
        start = tl.load(QStarts + r, mask=live, other=0)
        hit = live & (start <= t) & (t < start + tl.load(Extend + r, mask=live, other=0))
        found = tl.max(hit.to(tl.int32), axis=0) != 0
        b = tl.where(found, tl.sum(tl.where(hit, r, 0), axis=0), b)
        i = tl.where(found, t - tl.sum(tl.where(hit, start, 0), axis=0), i)
    return b, i


@triton.jit
def _query(SeqLens, Prefix, Extend, QStarts, Mask, MaskPtr, TailStart, p, nreq, tail_width,
           MODE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr):
    """(request b, token row t, key count L, keys taken from the table row, visible tree
    nodes [BLOCK_T], whether the query exists) of grid row p: request p of a decode, token
    row p of an extend (rows no request holds, a graph's padding, exist not)."""
    vis = tl.zeros((BLOCK_T,), dtype=tl.int1)
    if MODE == _DECODE:
        b, t, exists = p, p, p >= 0
        from_row = tl.load(SeqLens + b)
        length = from_row
    elif MODE == _TAIL:
        b, t, exists = p, p, p >= 0
        from_row = tl.load(TailStart + b).to(tl.int32)
        length = from_row + tail_width
    else:
        t = p
        b, i = _owner(Extend, QStarts, t, nreq, BLOCK_B)
        exists = b < nreq
        b = tl.where(exists, b, 0)
        n = tl.load(Extend + b)
        if MODE == _CAUSAL:  # every key is in the table row
            length = tl.load(Prefix + b) + i + 1
            from_row = length
        else:
            from_row = tl.load(Prefix + b)
            j = tl.arange(0, BLOCK_T)
            # j < n, or nothing when the query does not exist (a where: the interpreter
            # cannot mask with a scalar comparison and'ed into a vector)
            row_mask = tl.load(Mask + tl.load(MaskPtr + b) + i * n + j, mask=j < tl.where(exists, n, 0), other=0)
            vis = row_mask != 0
            length = from_row + tl.sum(vis.to(tl.int32), axis=0)
    return b, t, length, from_row, vis, exists


@triton.jit
def _split_len(length, BLOCK_N: tl.constexpr, S_CAP: tl.constexpr):
    """SPLIT(L): the module docstring's piece length."""
    split = length * 0 + BLOCK_N  # an int32 scalar tensor: the loop carries it
    while split * S_CAP < length:
        split *= 2
    return split


@triton.jit
def _slots(Table, row, tail, offs, valid, from_row, vis, MODE: tl.constexpr, BLOCK_T: tl.constexpr):
    """Pool slots of logical key positions `offs` (slot 0 where not `valid`); `tail`: this
    request's draft tail."""
    in_row = valid & (offs < from_row)
    slots = tl.load(Table + row + offs, mask=in_row, other=0)
    if MODE == _TREE:  # position from_row + r is the r-th visible node
        rank = tl.cumsum(vis.to(tl.int32), axis=0) - 1
        j = tl.arange(0, BLOCK_T)
        r = offs - from_row
        hit = vis[None, :] & (rank[None, :] == r[:, None])
        node = tl.sum(tl.where(hit, j[None, :], 0), axis=1)
        tree_slots = tl.load(Table + row + from_row + node, mask=valid & (r >= 0), other=0)
        slots = tl.where(in_row, slots, tree_slots)
    if MODE == _TAIL:
        tail_slots = tl.load(tail + offs - from_row, mask=valid & (offs >= from_row), other=0)
        slots = tl.where(in_row, slots, tail_slots)
    return slots


@triton.jit
def _partial_kernel(Q, K, V, Table, stride_table, Rows, SeqLens, Prefix, Extend, QStarts, Mask, MaskPtr,
                    Tail, stride_tail, TailStart, tail_width, nreq, PAcc, PM, PL, qk_scale,
                    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, H, G, D,
                    MODE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
                    S_CAP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
                    USE_PDL: tl.constexpr):
    kvh, piece = tl.program_id(1) // S_CAP, tl.program_id(1) % S_CAP
    wait_and_release(USE_PDL)
    b, t, length, from_row, vis, exists = _query(SeqLens, Prefix, Extend, QStarts, Mask, MaskPtr, TailStart,
                                                 tl.program_id(0), nreq, tail_width, MODE, BLOCK_T, BLOCK_B)
    split = _split_len(length, BLOCK_N, S_CAP)
    start = piece * split
    if exists & (start < length):
        end = tl.minimum(start + split, length)
        row = tl.load(Rows + b).to(tl.int64) * stride_table
        tail = Tail + b.to(tl.int64) * stride_tail
        g, offs_d = tl.arange(0, G_PAD), tl.arange(0, BLOCK_D)
        gmask, mask_d = g < G, offs_d < D
        heads = kvh * G + g
        q = tl.load(Q + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=gmask[:, None] & mask_d[None, :], other=0.0)
        acc = tl.zeros((G_PAD, BLOCK_D), dtype=tl.float32)
        m_i = tl.full((G_PAD,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((G_PAD,), dtype=tl.float32)
        for off in range(start, end, BLOCK_N):
            offs = off + tl.arange(0, BLOCK_N)
            valid = offs < end
            slots = _slots(Table, row, tail, offs, valid, from_row, vis, MODE, BLOCK_T)
            k = load_kv_block(K, slots, valid, stride_ks, kvh * stride_kh, offs_d, mask_d)
            v = load_kv_block(V, slots, valid, stride_vs, kvh * stride_vh, offs_d, mask_d)
            acc, m_i, l_i = online_softmax_step(q, k, v, valid[None, :], acc, m_i, l_i, qk_scale, PREC)
        cell = (t.to(tl.int64) * H + heads) * S_CAP + piece  # [G_PAD]
        tl.store(PAcc + cell[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None] & mask_d[None, :])
        tl.store(PM + cell, m_i, mask=gmask)
        tl.store(PL + cell, l_i, mask=gmask)


@triton.jit
def _merge_kernel(Out, PAcc, PM, PL, SeqLens, Prefix, Extend, QStarts, Mask, MaskPtr, TailStart, tail_width, nreq,
                  v_scale, stride_ot, stride_oh, H, D, MODE: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, S_CAP: tl.constexpr, BLOCK_D: tl.constexpr,
                  USE_PDL: tl.constexpr):
    """Grid row p's query, head h: its pieces merged in order, each into a running (max, sum, acc)."""
    h = tl.program_id(1)
    wait_and_release(USE_PDL)
    b, t, length, from_row, vis, exists = _query(SeqLens, Prefix, Extend, QStarts, Mask, MaskPtr, TailStart,
                                                 tl.program_id(0), nreq, tail_width, MODE, BLOCK_T, BLOCK_B)
    if exists:
        split = _split_len(length, BLOCK_N, S_CAP)
        pieces = tl.cdiv(length, split)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        base = (t.to(tl.int64) * H + h) * S_CAP
        # the running max and sum kept as [BLOCK_D] vectors of one value. The pieces are
        # unrolled to S_CAP, those past `pieces` left out by a select, so every load is
        # issued up front rather than one piece's after the last one's arithmetic
        m_run = tl.full((BLOCK_D,), float("-inf"), dtype=tl.float32)
        l_run = tl.zeros((BLOCK_D,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for piece in tl.static_range(S_CAP):
            live = pieces > piece
            at = base + tl.minimum(pieces - 1, piece)  # a piece past the last reads the last
            m_s = tl.load(PM + at)
            l_s = tl.load(PL + at)
            o_s = tl.load(PAcc + at * D + offs_d, mask=mask_d, other=0.0)
            m_new = tl.maximum(m_run, m_s)
            alpha, beta = tl.exp2(m_run - m_new), tl.exp2(m_s - m_new)
            l_run = tl.where(live, l_run * alpha + l_s * beta, l_run)
            acc = tl.where(live, acc * alpha + o_s * beta, acc)
            m_run = tl.where(live, m_new, m_run)
        out = acc / l_run * v_scale
        tl.store(Out + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty),
                 mask=mask_d)


def invariant_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor,
                        table: torch.Tensor, meta: TritonMeta, scale: float, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> None:
    """out [T, H, D] = attention of q [T, H, D] over the pools, for the batch described by
    `meta` (triton_backend.TritonMeta: decode, tail decode, causal extend or tree verify)."""
    t_rows, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    mode, grid_p, max_q, tail_width = _mode(meta, t_rows)
    width = max(16, triton.next_power_of_2(max_q)) if mode == TREE else 16
    pacc = torch.empty(t_rows, heads, S_CAP, dim, dtype=torch.float32, device=q.device)
    pm = torch.empty(t_rows, heads, S_CAP, dtype=torch.float32, device=q.device)
    pl = torch.empty_like(pm)
    rows = meta.req_rows
    dummy = rows
    seq = meta.seq_lens if meta.seq_lens is not None else dummy
    prefix = meta.prefix_lens if meta.prefix_lens is not None else dummy
    extend = meta.extend_lens if meta.extend_lens is not None else dummy
    starts = meta.q_starts if meta.q_starts is not None else dummy
    mask = meta.mask if meta.mask is not None else dummy
    mask_ptr = meta.mask_indptr if meta.mask_indptr is not None else dummy
    tail = meta.tail if meta.tail is not None else dummy.view(-1, 1)
    tail_start = meta.tail_start if meta.tail_start is not None else dummy
    group, nreq = heads // kv_heads, rows.shape[0]
    flags = pdl_flags(q.device)
    common = dict(MODE=mode, BLOCK_T=width, BLOCK_B=BLOCK_B, BLOCK_N=BLOCK_N, S_CAP=S_CAP, BLOCK_D=block_d(dim))
    _partial_kernel[(grid_p, kv_heads * S_CAP)](
        q, k_pool, v_pool, table, table.stride(0), rows, seq, prefix, extend, starts, mask, mask_ptr,
        tail, tail.stride(0), tail_start, tail_width, nreq, pacc, pm, pl, scale * k_scale * LOG2E,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        heads, group, dim, G_PAD=max(16, triton.next_power_of_2(group)),
        PREC=dot_precision(compute_dtype(q, k_pool)), num_warps=4, **common, **flags)
    _merge_kernel[(grid_p, heads)](
        out, pacc, pm, pl, seq, prefix, extend, starts, mask, mask_ptr, tail_start, tail_width, nreq, v_scale,
        out.stride(0), out.stride(1), heads, dim, num_warps=1, **common, **flags)


def _mode(meta: TritonMeta, t_rows: int) -> tuple[int, int, int, int]:
    """(MODE, grid rows, queries per request at most, tail width): a decode's grid has a
    row per request, an extend's a row per token row (`t_rows`, a graph's padding included)."""
    bsz = meta.req_rows.shape[0]
    if meta.tail is not None:
        return TAIL, bsz, 1, meta.tail.shape[1]
    if meta.prefix_lens is None:
        return DECODE, bsz, 1, 0
    return (TREE if meta.mask is not None else CAUSAL), t_rows, meta.max_extend, 0
