"""Drafts: the one structure every proposer returns and verify/accept consume.

Per request a tree of N nodes (padded to a common N for the batch):
  * node 0 is the root: the request's last committed token, whose KV is not computed yet;
  * parents[b, i] < i for every valid node i >= 1 (parents come before children), and
    parents[b, 0] = -1; a chain is the tree whose parent is the previous node;
  * valid[b, i] False marks padding (ragged trees). Padding nodes hang off the root with
    token 0 so they are harmless in verify; acceptance never walks into them.
From this come depths, positions (seq_len + depth), the ancestor-or-self tree mask, and
first-child / next-sibling lists (children in increasing node order, which proposers use
as their preference order: the first child is their best guess).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch


@dataclass
class Drafts:
    tokens: torch.Tensor  # [B, N] int64
    parents: torch.Tensor  # [B, N] int64
    valid: torch.Tensor  # [B, N] bool
    # Valid nodes per request, when the proposer knows them on the host (they are a prefix
    # of each row): lets verify size its batch without reading `valid` back from the device.
    counts: list[int] | None = None
    # The tree mask when the proposer computed it already (inside its CUDA graph)
    known_mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @staticmethod
    def from_lists(tokens: list[list[int]], parents: list[list[int]]) -> Drafts:
        """Ragged per-request trees (each list starts with the root) padded to one N."""
        n = max(len(t) for t in tokens)
        tok = torch.zeros(len(tokens), n, dtype=torch.int64)
        par = torch.zeros(len(tokens), n, dtype=torch.int64)
        val = torch.zeros(len(tokens), n, dtype=torch.bool)
        for b, (t, p) in enumerate(zip(tokens, parents)):
            assert p[0] == -1 and all(0 <= p[i] < i for i in range(1, len(p))), f"bad tree {p}"
            tok[b, :len(t)] = torch.tensor(t)
            par[b, :len(p)] = torch.tensor(p)
            val[b, :len(t)] = True
        par[:, 0] = -1
        return Drafts(tok, par, val, [len(t) for t in tokens])

    @staticmethod
    def chains(roots: list[int], drafts: list[list[int]]) -> Drafts:
        """Linear chains root -> d1 -> d2 ... (possibly of different lengths)."""
        return Drafts.from_lists([[r] + d for r, d in zip(roots, drafts)],
                                 [list(range(-1, len(d))) for d in drafts])

    @staticmethod
    def roots(tokens: list[int], device: torch.device | str = "cpu") -> Drafts:
        """Root-only trees (nothing drafted) for requests whose last tokens are `tokens`."""
        bsz = len(tokens)
        tok = torch.tensor(tokens, dtype=torch.int64)[:, None].to(device, non_blocking=True)
        return Drafts(tok, torch.full((bsz, 1), -1, dtype=torch.int64, device=device),
                      torch.ones(bsz, 1, dtype=torch.bool, device=device), [1] * bsz)

    def with_rows(self, rows: list[int], other: Drafts) -> Drafts:
        """These drafts with requests `rows` replaced by `other`'s (padded to a common N)."""
        n = max(self.num_nodes, other.num_nodes)
        base, other = self.padded(n), other.padded(n)
        idx = torch.tensor(rows, dtype=torch.int64).to(base.tokens.device, non_blocking=True)
        tokens, parents, valid = (t.index_copy(0, idx, o) for t, o in (
            (base.tokens, other.tokens), (base.parents, other.parents), (base.valid, other.valid)))
        counts = list(base.valid_counts())
        for r, c in zip(rows, other.valid_counts()):
            counts[r] = c
        return Drafts(tokens, parents, valid, counts)

    def select(self, rows: list[int], index: torch.Tensor) -> Drafts:
        """The trees of requests `rows` (`index`: the same rows on the trees' device)."""
        mask = self.known_mask.index_select(0, index) if self.known_mask is not None else None
        counts = [self.counts[i] for i in rows] if self.counts is not None else None
        return Drafts(self.tokens.index_select(0, index), self.parents.index_select(0, index),
                      self.valid.index_select(0, index), counts, mask)

    def padded(self, n: int) -> Drafts:
        """The same trees padded to n nodes per request (invalid nodes hanging off the root)."""
        extra = n - self.num_nodes
        if extra <= 0:
            return self
        bsz = self.batch_size
        return Drafts(torch.cat([self.tokens, self.tokens.new_zeros(bsz, extra)], 1),
                      torch.cat([self.parents, self.parents.new_zeros(bsz, extra)], 1),
                      torch.cat([self.valid, self.valid.new_zeros(bsz, extra)], 1), self.counts)

    def valid_counts(self) -> list[int]:
        """Valid nodes per request (host-side when known, else read from `valid`)."""
        return self.counts if self.counts is not None else self.valid.sum(1).tolist()

    def depths(self) -> torch.Tensor:
        """[B, N] int64: the number of ancestors of each node (root 0)."""
        return self._mask.sum(-1, dtype=torch.int64) - 1

    def positions(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """[B, N] RoPE positions: the root sits at seq_len (its KV is not cached yet)."""
        return seq_lens[:, None] + self.depths()

    def tree_mask(self) -> torch.Tensor:
        """[B, N, N] bool: mask[b, i, j] iff node j is node i or one of its ancestors."""
        return self._mask

    @cached_property
    def _mask(self) -> torch.Tensor:
        return self.known_mask if self.known_mask is not None else ancestor_mask(self.parents)

    def child_lists(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(first_child, next_sibling), each [B, N] int64 with -1 for none; valid nodes only.

        Children are in increasing node order: node i's next sibling is the smallest j > i
        with the same parent, a parent's first child the smallest such j. Computed with
        [B, N, N] comparisons (N <= a few dozen), no per-node Python loop."""
        bsz, n = self.tokens.shape
        idx = torch.arange(n, device=self.tokens.device)
        child = self.valid & (idx > 0)  # the root is nobody's child
        none = torch.full((), n, device=self.tokens.device)
        # is_child[b, p, j]: node j is a valid child of node p
        is_child = (self.parents[:, None, :] == idx[None, :, None]) & child[:, None, :]
        first = torch.where(is_child, idx, none).min(-1).values
        same = (self.parents[:, :, None] == self.parents[:, None, :]) & child[:, None, :] \
            & (idx[None, :] > idx[:, None])
        sibling = torch.where(same, idx, none).min(-1).values
        first = torch.where((first == n) | ~self.valid, -1, first)
        sibling = torch.where((sibling == n) | ~child, -1, sibling)
        return first, sibling


HOST_NODES = 63  # a CPU tree of up to this many nodes: its mask from int64 bitsets (`_host_mask`)
HOST_LOOP = 256  # trees x nodes up to which Python ints beat numpy's per-node ops


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] parents -> [B, N, N] bool ancestor-or-self relation, by repeated squaring of
    the one-step relation (self + parent): ceil(log2 N) batched matmuls on the parents'
    device, no per-node loop (trees live on the GPU; a loop would be N launches per step).
    A small tree on the CPU takes `_host_mask`: the same relation as bitsets."""
    bsz, n = parents.shape
    if not parents.is_cuda and n <= HOST_NODES:
        mask = _host_mask(parents)
        if mask is not None:
            return mask
    step = torch.eye(n, device=parents.device).repeat(bsz, 1, 1)
    has_parent = parents >= 0
    step.scatter_add_(2, parents.clamp_min(0)[:, :, None], has_parent[:, :, None].to(step.dtype))
    reach = step > 0
    for _ in range(math.ceil(math.log2(n)) if n > 1 else 0):
        r = reach.to(torch.float32)  # path counts stay <= N: exact in float32
        reach = torch.bmm(r, r) > 0
    return reach


def _host_mask(parents: torch.Tensor) -> torch.Tensor | None:
    """ancestor_mask on the host, one pass in node order: a node reaches itself and what
    its parent reaches, each node's set an int64 bitset (bit j: node j), unpacked at the
    end. None unless every parent comes before its child (the module's rule). A few trees
    (batch 1) run as Python ints: each numpy call costs about what a tree's whole pass does."""
    par = parents.numpy()
    bsz, n = par.shape
    if not (par[:, 1:] < np.arange(1, n)).all():
        return None
    if bsz * n <= HOST_LOOP:
        reach = []
        for row in par.tolist():
            bits = [1] * n
            for i in range(1, n):
                p = row[i]
                bits[i] = (bits[p] if p >= 0 else 0) | (1 << i)
            reach.append(bits)
        sets = np.array(reach, dtype=np.int64)
    else:
        sets = np.zeros((bsz, n), dtype=np.int64)
        sets[:, 0] = 1
        rows = np.arange(bsz)
        for i in range(1, n):
            p = par[:, i]
            sets[:, i] = np.where(p >= 0, sets[rows, np.maximum(p, 0)], 0) | (1 << i)
    return torch.from_numpy((sets[:, :, None] >> np.arange(n, dtype=np.int64)) & 1 != 0)
