"""The greedy accept walk over draft trees in one Triton launch per batch.

`spec.accept._accept_greedy` (the torch reference and the CPU path) finds, per request, the
path of drafted nodes the target agrees with: a node *hits* when it is valid, carries the
target's argmax at its parent and no earlier sibling hits; it is accepted when it and all
its ancestors hit; the walk ends at the deepest accepted node, whose argmax is the bonus.
In torch that is about twenty small launches over [B, N] and [B, N, N] tensors, paid every
speculative step at batch 1. Here one program owns one request's tree (N <= MAX_N nodes in
registers): hits and sibling shadowing as [N, N] compares, acceptance (every ancestor
hits) and the path (the deepest accepted node's ancestors) from the trees' ancestor masks,
each one [N, N] reduction (parents come before children, so the deepest accepted node is
the accepted node of largest index). The target's argmax comes in as each row's chunk
maxima (argmax.py, many programs; for seeded sampling, of the tempered and perturbed
logits), which the walk reduces: torch's argmax runs one block per row, too few for a
verify's long rows, and propagating hits along the tree in 2N rounds costs more than
the walk's few [N, N] reductions over the ancestor masks.

Output per request b, the row the host reads back: out[b] = [on_path (N), tokens (N), bonus]
as int64, on_path[i] = 1 for the accepted path's nodes (root included).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import Tempered, pdl_flags
from specserve.kernels.argmax import chunk_maxima, first_of_maxima
from specserve.kernels.pdl import wait_and_release

MAX_N = 64  # nodes per tree held in one program


@triton.jit
def _walk_kernel(tok_ptr, par_ptr, valid_ptr, mask_ptr, val_ptr, idx_ptr, out_ptr, N, C,
                 BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr):
    wait_and_release(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    live = i < N
    tok = tl.load(tok_ptr + b * N + i, mask=live, other=-1)
    par = tl.load(par_ptr + b * N + i, mask=live, other=-2)  # -1: the root; -2: no node
    valid = tl.load(valid_ptr + b * N + i, mask=live, other=0) != 0
    # the argmax at each node from its chunks' (max, first index): the first of the maxima
    target = first_of_maxima(val_ptr, idx_ptr, b * N + i, C, live, BLOCK_C)
    at_parent = tl.sum(tl.where(par[:, None] == i[None, :], target[None, :], 0), axis=1)
    hit = ((tok == at_parent) & valid) | (i == 0)  # the root is given
    # an earlier sibling that hits shadows a later one: hits are unique per parent
    shadow = (par[:, None] == par[None, :]) & (i[None, :] < i[:, None]) & hit[None, :]
    hit = hit & (tl.max(shadow.to(tl.int32), axis=1) == 0)
    # anc[k, j]: node j is node k or one of its ancestors; k is accepted iff all of them hit
    anc = tl.load(mask_ptr + b * N * N + i[:, None] * N + i[None, :], mask=live[:, None] & live[None, :],
                  other=0) != 0
    accepted = hit & (tl.min(tl.where(anc, hit[None, :].to(tl.int32), 1), axis=1) > 0)
    best = tl.max(tl.where(accepted, i, -1), axis=0)  # the deepest: parents come before children
    on = tl.max(tl.where((i == best)[:, None] & anc, 1, 0), axis=0)  # best and its ancestors
    row = out_ptr + b * (2 * N + 1)
    tl.store(row + i, on.to(tl.int64), mask=live)
    tl.store(row + N + i, tok.to(tl.int64), mask=live)
    tl.store(row + 2 * N, tl.sum(tl.where(i == best, target, 0), axis=0).to(tl.int64))


def supports(num_nodes: int) -> bool:
    return num_nodes <= MAX_N


def greedy_walk(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, mask: torch.Tensor,
                logits: torch.Tensor, tempered: Tempered | None = None) -> torch.Tensor:
    """tokens, parents int64 [B, N], valid bool [B, N], ancestor masks bool [B, N, N] and
    the target's logits [B, N, V] -> out int64 [B, 2N + 1] (module docstring). With
    `tempered` (per_request N), the targets are seeded sampling's (argmax.py)."""
    bsz, n = tokens.shape
    v = logits.shape[-1]
    out = torch.empty(bsz, 2 * n + 1, dtype=torch.int64, device=tokens.device)
    if bsz:
        x = logits.reshape(bsz * n, v)
        if x.stride(-1) != 1:
            x = x.contiguous()
        val, idx = chunk_maxima(x, tempered)
        chunks = val.shape[1]
        _walk_kernel[(bsz,)](tokens.contiguous(), parents.contiguous(), valid.contiguous(),
                             mask.contiguous().view(torch.uint8), val, idx, out, n, chunks,
                             BLOCK=max(16, triton.next_power_of_2(n)),
                             BLOCK_C=max(2, triton.next_power_of_2(chunks)), **pdl_flags(x.device))
    return out
