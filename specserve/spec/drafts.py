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

from dataclasses import dataclass

import torch


@dataclass
class Drafts:
    tokens: torch.Tensor  # [B, N] int64
    parents: torch.Tensor  # [B, N] int64
    valid: torch.Tensor  # [B, N] bool

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @staticmethod
    def from_lists(tokens: list[list[int]], parents: list[list[int]]) -> "Drafts":
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
        return Drafts(tok, par, val)

    @staticmethod
    def chains(roots: list[int], drafts: list[list[int]]) -> "Drafts":
        """Linear chains root -> d1 -> d2 ... (possibly of different lengths)."""
        return Drafts.from_lists([[r] + d for r, d in zip(roots, drafts)],
                                 [list(range(-1, len(d))) for d in drafts])

    def padded(self, n: int) -> "Drafts":
        """The same trees padded to n nodes per request (invalid nodes hanging off the root)."""
        extra = n - self.num_nodes
        if extra <= 0:
            return self
        bsz = self.batch_size
        return Drafts(torch.cat([self.tokens, self.tokens.new_zeros(bsz, extra)], 1),
                      torch.cat([self.parents, self.parents.new_zeros(bsz, extra)], 1),
                      torch.cat([self.valid, self.valid.new_zeros(bsz, extra)], 1))

    def depths(self) -> torch.Tensor:
        """[B, N] int64: the number of ancestors of each node (root 0)."""
        depth = torch.zeros_like(self.parents)
        for i in range(1, self.num_nodes):  # parents precede children: one pass suffices
            depth[:, i] = depth.gather(1, self.parents[:, i:i + 1].clamp_min(0))[:, 0] + 1
        return depth

    def positions(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """[B, N] RoPE positions: the root sits at seq_len (its KV is not cached yet)."""
        return seq_lens[:, None] + self.depths()

    def tree_mask(self) -> torch.Tensor:
        """[B, N, N] bool: mask[b, i, j] iff node j is node i or one of its ancestors."""
        bsz, n = self.tokens.shape
        mask = torch.eye(n, dtype=torch.bool).repeat(bsz, 1, 1)
        for i in range(1, n):  # row i = row of its parent + itself
            parent_rows = mask[torch.arange(bsz), self.parents[:, i].clamp_min(0)]
            mask[:, i] |= parent_rows
        return mask

    def child_lists(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(first_child, next_sibling), each [B, N] int64 with -1 for none; valid nodes only.

        Children are in increasing node order: node i's next sibling is the smallest j > i
        with the same parent, a parent's first child the smallest such j. Computed with
        [B, N, N] comparisons (N <= a few dozen), no per-node Python loop."""
        bsz, n = self.tokens.shape
        idx = torch.arange(n)
        child = self.valid & (idx > 0)  # the root is nobody's child
        none = torch.full((), n)
        # is_child[b, p, j]: node j is a valid child of node p
        is_child = (self.parents[:, None, :] == idx[None, :, None]) & child[:, None, :]
        first = torch.where(is_child, idx, none).min(-1).values
        same = (self.parents[:, :, None] == self.parents[:, None, :]) & child[:, None, :] & (idx[None, :] > idx[:, None])
        sibling = torch.where(same, idx, none).min(-1).values
        first = torch.where((first == n) | ~self.valid, -1, first)
        sibling = torch.where((sibling == n) | ~child, -1, sibling)
        return first, sibling
