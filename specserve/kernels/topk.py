"""Top-k log-probabilities of draft logits in one Triton launch per batch of rows.

A tree drafter scores every frontier node's children by log-softmax and keeps the k best
(`spec.tree_draft.top_children`). In torch that is a two-stage top-k, a logsumexp, a
subtraction and a vocabulary-map gather: about fifteen launches per drafting depth, each
a few microseconds at batch 1, where a speculative step is bound by launches. Here one
program owns one row: it loads the whole row (V <= MAX_V, fp32 in registers), takes the
log-sum-exp, then extracts the k largest by k rounds of one max-with-index reduction
each (a separate max and argmax would be two), masking its winner.

Result for row r: vals[r, j] = x[r, i_j] - logsumexp(x[r]) (float32) and ids[r, j] =
map[i_j] (i_j without a map), j = 0..k-1 in descending value. Ties go to the lower index
(torch.topk leaves their order unspecified); the values are the same either way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_V = 32768  # one row in one block; larger vocabularies take the torch path


@triton.jit
def _topk_logprob_kernel(x_ptr, map_ptr, vals_ptr, ids_ptr, V, stride_x,
                         K: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    lse = m + tl.log(tl.sum(tl.exp(x - m), axis=0))
    for j in tl.static_range(K):
        best, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(vals_ptr + row * K + j, best - lse)
        if HAS_MAP:
            tl.store(ids_ptr + row * K + j, tl.load(map_ptr + i).to(tl.int64))
        else:
            tl.store(ids_ptr + row * K + j, i.to(tl.int64))
        x = tl.where(cols == i, float("-inf"), x)  # the winner leaves the row


def supports(v: int, k: int) -> bool:
    return v <= MAX_V and 0 < k <= min(v, 32)


def topk_logprobs(logits: torch.Tensor, k: int,
                  token_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities float32 [R, k], ids int64 [R, k]) of each row's k best entries of
    logits [R, V] (V <= MAX_V), ids mapped through `token_map` [V] when given."""
    r, v = logits.shape
    assert supports(v, k), (v, k)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    vals = torch.empty(r, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(r, k, dtype=torch.int64, device=logits.device)
    if r == 0:
        return vals, ids
    block = triton.next_power_of_2(v)
    _topk_logprob_kernel[(r,)](logits, token_map if token_map is not None else ids, vals, ids, v,
                               logits.stride(0), K=k, HAS_MAP=token_map is not None, BLOCK=block,
                               num_warps=4 if block <= 4096 else 8 if block <= 16384 else 16)
    return vals, ids
