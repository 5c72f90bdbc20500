"""The greedy accept walk over draft trees in one Triton launch per batch.

`spec.accept._accept_greedy` (the torch reference and the CPU path) finds, per request, the
path of drafted nodes the target agrees with: a node *hits* when it is valid, carries the
target's argmax at its parent and no earlier sibling hits; it is accepted when it and all
its ancestors hit; the walk ends at the deepest accepted node, whose argmax is the bonus.
In torch that is about twenty small launches over [B, N] and [B, N, N] tensors, paid every
speculative step at batch 1. Here one program owns one request's tree (N <= MAX_N nodes in
registers): hits and sibling shadowing as [N, N] compares, acceptance and the path's
ancestors by N rounds of propagation along the parent one-hot matrix (parents come before
children, so the deepest accepted node is the accepted node of largest index).

Output per request b, the row the host reads back: out[b] = [on_path (N), tokens (N), bonus]
as int64, on_path[i] = 1 for the accepted path's nodes (root included).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_N = 64  # nodes per tree held in one program


@triton.jit
def _walk_kernel(tok_ptr, par_ptr, valid_ptr, target_ptr, out_ptr, N, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    live = i < N
    tok = tl.load(tok_ptr + b * N + i, mask=live, other=-1)
    par = tl.load(par_ptr + b * N + i, mask=live, other=-2)  # -1: the root; -2: no node
    valid = tl.load(valid_ptr + b * N + i, mask=live, other=0) != 0
    at_parent = tl.load(target_ptr + b * N + tl.maximum(par, 0), mask=live, other=-1)
    hit = ((tok == at_parent) & valid) | (i == 0)  # the root is given
    # an earlier sibling that hits shadows a later one: hits are unique per parent
    shadow = (par[:, None] == par[None, :]) & (i[None, :] < i[:, None]) & hit[None, :]
    hit = hit & (tl.max(shadow.to(tl.int32), axis=1) == 0)
    child_of = (par[:, None] == i[None, :]).to(tl.int32)  # [k, j]: node k's parent is j
    hit = hit.to(tl.int32)
    root = (i == 0).to(tl.int32)
    acc = hit
    for _ in range(N):  # accepted = hits whose parent is accepted (the root has none)
        acc = hit * tl.maximum(tl.max(child_of * acc[None, :], axis=1), root)
    best = tl.max(tl.where(acc > 0, i, -1), axis=0)
    on = (i == best).to(tl.int32)
    for _ in range(N):  # the path: best and its ancestors
        on = tl.maximum(on, tl.max(child_of * on[:, None], axis=0))
    row = out_ptr + b * (2 * N + 1)
    tl.store(row + i, on.to(tl.int64), mask=live)
    tl.store(row + N + i, tok.to(tl.int64), mask=live)
    tl.store(row + 2 * N, tl.load(target_ptr + b * N + best).to(tl.int64))


def supports(num_nodes: int) -> bool:
    return num_nodes <= MAX_N


def greedy_walk(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor,
                target: torch.Tensor) -> torch.Tensor:
    """tokens, parents, target (the argmax at each node) int64 [B, N], valid bool [B, N]
    -> out int64 [B, 2N + 1] (module docstring)."""
    bsz, n = tokens.shape
    out = torch.empty(bsz, 2 * n + 1, dtype=torch.int64, device=tokens.device)
    if bsz:
        _walk_kernel[(bsz,)](tokens.contiguous(), parents.contiguous(), valid.contiguous(), target.contiguous(),
                             out, n, BLOCK=max(16, triton.next_power_of_2(n)))
    return out
