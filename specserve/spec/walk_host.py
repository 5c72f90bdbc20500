"""The greedy walk on the host: spec/accept.py's rule over Python lists, for logits on the
CPU, where each of the vectorised walk's dozen small tensor ops (`_walk_torch`) costs
microseconds that a batch-1 step on a CPU cannot spare; and for trees drafted on the host
(NGRAM's) on a GPU at small batches (accept.py `HOST_WALK_ROWS`): the target's argmax is
taken there and read back, instead of copying the trees (tokens, parents, valid flags,
masks) to the GPU for the walk kernel, four copies a step that cost the host more than the
walk.

The rule is `accept.walk_greedy`'s: a node *hits* when it is valid, carries the target's
argmax at its parent and no earlier sibling hits; a node is accepted when it and every
ancestor hit (parents come before children, so one pass in node order decides it); the
walk ends at the deepest accepted node (the largest index), whose argmax is the bonus.
Invariant: `walk_host` returns what `_parse_walk(walk_greedy(...))` returns.
"""
from __future__ import annotations

import torch

from specserve import kernels
from specserve.kernels import cpu_rows
from specserve.spec.drafts import Drafts


def walk_host(drafts: Drafts, logits: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
    """(paths, tokens) of every row's greedy walk; logits [B, N, V] on any device (the
    argmax read back is the one sync), the trees on the host."""
    targets = _targets(logits).tolist()
    rows = zip(drafts.tokens.tolist(), drafts.parents.tolist(), drafts.valid.tolist(), targets)
    paths, tokens = [], []
    for tok, par, valid, target in rows:
        path = _path(tok, par, valid, target)
        paths.append(path)
        tokens.append([tok[i] for i in path[1:]] + [target[path[-1]]])
    return paths, tokens


def _targets(logits: torch.Tensor) -> torch.Tensor:
    """[B, N] the target's argmax at every node, first on ties: the fused kernels' where
    they run (kernels/argmax.py, many programs a row), else torch's or the CPU's own."""
    if kernels.use_fused(logits):
        from specserve.kernels import argmax  # Triton: imported where the kernels run

        bsz, n, vocab = logits.shape
        return argmax.argmax(logits.reshape(bsz * n, vocab)).view(bsz, n)
    return logits.argmax(-1) if logits.is_cuda else cpu_rows.argmax(logits)


def _path(tok: list[int], par: list[int], valid: list[bool], target: list[int]) -> list[int]:
    """The accepted path of one tree, root first."""
    accepted = [True] + [False] * (len(tok) - 1)
    taken: set[int] = set()  # parents one of whose children hit already
    deepest = 0
    for i in range(1, len(tok)):
        p = par[i]
        if not valid[i] or p < 0 or p in taken or tok[i] != target[p]:
            continue
        taken.add(p)
        if accepted[p]:
            accepted[i] = True
            deepest = i
    path = [deepest]
    while path[-1] != 0:
        path.append(par[path[-1]])
    return path[::-1]
