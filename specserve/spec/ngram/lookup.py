"""NGRAM drafted on the device, for pipelined steps: each request's tokens matched against its own suffix.

The trie (trie.py) lives on the host, so a draft from it for step k+1 needs step k's tokens
read back: such a step cannot be launched before the previous one is read (pipeline.py).
This matcher keeps each request's ids on the device and drafts there, from the walk, so
NGRAM steps can be left in flight as EAGLE's are:

  * `ids` [table rows, C] holds each row's tokens: all_ids as the host knows them (`sync`,
    before a step drafted from the host's state), then each pipelined step's committed
    tokens (`draft_ahead`, from the walk, on the device). Invariant: before a draft, a
    request's row holds its all_ids at positions 0 .. kv_len (the root last), whatever
    the host has read back;
  * `draft` matches the last tokens against the request's earlier ones (the max match
    window down to the min, match.py) and drafts the tokens that followed
    the best match as a chain of N nodes from the root: every step verifies a full chain,
    as a pipelined step must (no host gate);
  * `draft_ahead` also writes the commit's table cells (the kept nodes' slots at their
    positions, as the host's commit would) and returns kv_len after it, as STANDALONE's
    catch-up does (standalone/ahead.py): the commit, the tokens and the match in one
    launch on a GPU, as the host's dispatch of a dozen torch ops costs more than the
    verify they follow at batch 1.

It drafts from one request's own tokens (prompt lookup), where the trie also holds other
requests' n-grams and drafts trees; lossless either way, as every draft is verified.
"""
from __future__ import annotations

import torch

from specserve.core.h2d import h2d_many
from specserve.core.request import Req
from specserve.spec.accept import GreedyWalk
from specserve.spec.drafts import Drafts
from specserve.spec.ngram.match import commit_and_match, suffix_match


class DeviceLookup:
    """Each table row's token ids on the device, and the chains drafted from them."""

    def __init__(self, table: torch.Tensor, num_nodes: int, max_w: int, min_w: int) -> None:
        self.table = table  # the target's req_to_token table (device), which draft_ahead's commit writes
        rows, columns = table.shape
        self.ids = torch.zeros(rows, columns + num_nodes, dtype=torch.int64, device=table.device)
        self.n, self.max_w, self.min_w = num_nodes, max_w, min_w
        self._synced: dict[str, int] = {}  # rid -> leading ids of the request known to be in its row
        self._chains: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def forget(self, req: Req) -> None:
        """The request left its row (finished, aborted or retracted)."""
        self._synced.pop(req.rid, None)

    def sync(self, reqs: list[Req]) -> None:
        """Write the host's ids of `reqs` the rows may lack, in one copy."""
        stride = self.ids.stride(0)
        index: list[int] = []
        tokens: list[int] = []
        for req in reqs:
            ids, have = req.all_ids, self._synced.get(req.rid, 0)
            if have < len(ids):
                index += range(req.row * stride + have, req.row * stride + len(ids))
                tokens += ids[have:]
                self._synced[req.rid] = len(ids)
        if index:
            idx, tok = h2d_many([index, tokens], self.ids.device)
            self.ids.view(-1).index_copy_(0, idx, tok)

    def draft(self, reqs: list[Req]) -> Drafts:
        """Chains from the host's state of `reqs` (synced first)."""
        self.sync(reqs)
        rows, lens = h2d_many([[r.row for r in reqs], [len(r.all_ids) for r in reqs]], self.ids.device)
        return self._chain(rows, lens)

    def draft_ahead(self, walk: GreedyWalk, slots: torch.Tensor,
                    row_start: torch.Tensor) -> tuple[Drafts, torch.Tensor]:
        """The commit's table writes, the committed tokens into `ids` and the next chains,
        from a walk over chains [B, N] whose verify slots are `slots` [B, N]; row_start
        [2B]: table rows, then kv_lens before the verify. (drafts, kv_len after [B]); one
        launch on a GPU (match.py `commit_and_match`)."""
        tokens, kv_after = commit_and_match(walk.on_path, walk.tokens, walk.bonus, slots.contiguous(), row_start,
                                            self.table, self.ids, self.max_w, self.min_w)
        return self._drafts(tokens), kv_after

    def _chain(self, rows: torch.Tensor, lens: torch.Tensor) -> Drafts:
        return self._drafts(suffix_match(self.ids, rows, lens, self.max_w, self.min_w, self.n))

    def _drafts(self, tokens: torch.Tensor) -> Drafts:
        """Chains of N nodes with these tokens (the root first); their parents and mask cached per batch size."""
        b = tokens.shape[0]
        if b not in self._chains:
            n, dev = self.n, self.ids.device
            parents = (torch.arange(n, device=dev) - 1).expand(b, n).contiguous()
            mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril().expand(b, n, n).contiguous()
            self._chains[b] = (parents, torch.ones(b, n, dtype=torch.bool, device=dev), mask)
        parents, valid, mask = self._chains[b]
        return Drafts(tokens, parents, valid, [self.n] * b, mask)
