"""Top-k log-probabilities of draft logits in one Triton launch per batch of rows.

A tree drafter scores every frontier node's children by log-softmax and keeps the k best
(`spec.tree_draft.top_children`). In torch that is a two-stage top-k, a logsumexp, a
subtraction and a vocabulary-map gather: about fifteen launches per drafting depth, each
a few microseconds at batch 1, where a speculative step is bound by launches. Here two
launches do it. First, a program per chunk of CHUNK logits takes the chunk's max and sum
of exponentials and extracts its k largest by k rounds of one max-with-index reduction
each (a separate max and argmax would be two), masking its winner. Then a program per
row merges its chunks: the log-sum-exp, and the k best of the chunks' candidates. One
program per whole row would run its k block-wide reductions in series over the whole
vocabulary on only as many programs as there are rows (a handful at batch 1).

Result for row r: vals[r, j] = x[r, i_j] - logsumexp(x[r]) (float32) and ids[r, j] =
map[i_j] (i_j without a map), j = 0..k-1 in descending value. Ties go to the lower index
(torch.topk leaves their order unspecified); the values are the same either way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl_flags
from specserve.kernels.pdl import wait_and_release

MAX_V = 32768  # rows longer than this take the torch path
CHUNK = 2048  # logits per program of the first stage
Into = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (dst rows [R], vals [rows, k], ids [rows, k])


@triton.jit
def _chunk_kernel(x_ptr, m_ptr, s_ptr, vals_ptr, idx_ptr, V, stride_x, C,
                  K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (r, c): chunk c of row r's max m, sum of exp(x - m), and its k best values
    and indices in descending order (ties: lower index first; -inf past the row's end)."""
    wait_and_release(USE_PDL)  # the logits are the kernel before's
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # a chunk of -inf logits (masked) sums to 0
    tl.store(m_ptr + row * C + c, m)
    tl.store(s_ptr + row * C + c, tl.sum(tl.exp(x - m_safe), axis=0))
    out = (row * C + c) * K
    for j in tl.static_range(K):
        best, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(vals_ptr + out + j, best)
        tl.store(idx_ptr + out + j, c * BLOCK + i)
        x = tl.where(cols == c * BLOCK + i, float("-inf"), x)  # the winner leaves the chunk


@triton.jit
def k_best(x, cand, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K largest of x [BLOCK] (positions `cand` = arange) in descending order, ties
    to the lower position: (values float32 [BLOCK_K], positions int32 [BLOCK_K]), held in
    registers so a caller can issue every load that depends on them at once (a load per
    round would put K memory round trips in series)."""
    j = tl.arange(0, BLOCK_K)
    vals = tl.zeros([BLOCK_K], dtype=tl.float32)
    pos = tl.zeros([BLOCK_K], dtype=tl.int32)
    for r in tl.static_range(K):
        best, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        vals = tl.where(j == r, best, vals)
        pos = tl.where(j == r, i, pos)
        x = tl.where(cand == i, float("-inf"), x)  # the winner leaves
    return vals, pos


@triton.jit
def _merge_kernel(m_ptr, s_ptr, cvals_ptr, cidx_ptr, map_ptr, vals_ptr, ids_ptr, dst_ptr, vals2_ptr, ids2_ptr, C,
                  K: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCK_K: tl.constexpr, INTO: tl.constexpr, USE_PDL: tl.constexpr):
    """Row r: the log-sum-exp from its chunks' (m, s), then the k best of its chunks' C*k
    candidates, laid out chunk-major so that the first of equal values has the lower index.
    Every load is issued up front and the winners' indices gathered in registers. INTO:
    the row's results also go to row dst[r] of vals2 / ids2 ([rows, K] each)."""
    wait_and_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    m = tl.load(m_ptr + row * C + c, mask=c < C, other=float("-inf"))
    s = tl.load(s_ptr + row * C + c, mask=c < C, other=0.0)
    cand = tl.arange(0, BLOCK)
    live = cand < C * K
    x = tl.load(cvals_ptr + row * C * K + cand, mask=live, other=float("-inf"))
    idx = tl.load(cidx_ptr + row * C * K + cand, mask=live, other=0)
    top = tl.max(m, axis=0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))
    best_v, pos = k_best(x, cand, K, BLOCK_K)
    best_i = tl.sum(tl.where(cand[None, :] == pos[:, None], idx[None, :], 0), axis=1)  # [BLOCK_K]
    j = tl.arange(0, BLOCK_K)
    keep = j < K
    vals = best_v - lse
    ids = best_i.to(tl.int64)
    if HAS_MAP:
        ids = tl.load(map_ptr + best_i, mask=keep, other=0).to(tl.int64)
    tl.store(vals_ptr + row * K + j, vals, mask=keep)
    tl.store(ids_ptr + row * K + j, ids, mask=keep)
    if INTO:
        there = tl.load(dst_ptr + row).to(tl.int64) * K
        tl.store(vals2_ptr + there + j, vals, mask=keep)
        tl.store(ids2_ptr + there + j, ids, mask=keep)


def supports(v: int, k: int) -> bool:
    return v <= MAX_V and 0 < k <= min(v, 32)


def topk_logprobs(logits: torch.Tensor, k: int, token_map: torch.Tensor | None = None,
                  into: Into | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities float32 [R, k], ids int64 [R, k]) of each row's k best entries of
    logits [R, V] (V <= MAX_V), ids mapped through `token_map` [V] when given; with `into`
    = (dst [R], vals2 [rows, k] float32, ids2 [rows, k] int64) row r's also go to row dst[r]."""
    r, v = logits.shape
    assert supports(v, k), (v, k)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    vals = torch.empty(r, k, dtype=torch.float32, device=dev)
    ids = torch.empty(r, k, dtype=torch.int64, device=dev)
    if r == 0:
        return vals, ids
    block = min(CHUNK, triton.next_power_of_2(v))
    chunks = triton.cdiv(v, block)
    m, s = (torch.empty(r, chunks, dtype=torch.float32, device=dev) for _ in range(2))
    cvals = torch.empty(r, chunks, k, dtype=torch.float32, device=dev)
    cidx = torch.empty(r, chunks, k, dtype=torch.int32, device=dev)
    _chunk_kernel[(r, chunks)](logits, m, s, cvals, cidx, v, logits.stride(0), chunks, K=k, BLOCK=block,
                               num_warps=4, **pdl_flags(dev))
    if into is not None:
        assert into[0].shape == (r,) and all(t.is_contiguous() and t.shape[1] == k for t in into[1:]), "rows of k"
        assert into[1].dtype == torch.float32 and into[2].dtype == torch.int64
    _merge_kernel[(r,)](m, s, cvals, cidx, token_map if token_map is not None else ids, vals, ids,
                        *(into if into is not None else (ids, vals, ids)), chunks, K=k, INTO=into is not None,
                        HAS_MAP=token_map is not None, BLOCK_C=max(2, triton.next_power_of_2(chunks)),
                        BLOCK=max(16, triton.next_power_of_2(chunks * k)), BLOCK_K=max(2, triton.next_power_of_2(k)),
                        num_warps=4, **pdl_flags(dev))
    return vals, ids
