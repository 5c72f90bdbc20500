"""RootStates: a draft's per-request output at the root, kept on the device between steps.

Per table row, the draft's output at the root: the root's top-k children and (EAGLE: at
the row's last draft-KV position, kv_len - 1) the hidden their depth-1 forwards take; a
draft LLM (STANDALONE) keeps no hidden (width 0: `hidden` is None). Device buffers indexed
by row, written and read for a whole batch in one index op each. One extra row past the
table's (`scratch_row`) takes the writes of a CUDA graph's padding requests, so a padded
batch never writes a real request's state twice in one index op.
"""
from __future__ import annotations

import torch

from specserve.core.h2d import h2d
from specserve.core.request import Req

RootState = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]  # logp [B, k], ids [B, k], hidden [B, H]


class RootStates:
    def __init__(self, rows: int, topk: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.scratch_row = rows
        self.logp = torch.zeros(rows + 1, topk, dtype=torch.float32, device=device)  # log-probabilities
        self.ids = torch.zeros(rows + 1, topk, dtype=torch.int64, device=device)  # target token ids
        self.hidden = torch.zeros(rows + 1, width, dtype=dtype, device=device) if width else None
        self.ready: set[str] = set()  # request ids whose row holds a state

    def write(self, rows: torch.Tensor, logp: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """Device only (CUDA graphs capture it): the states of table rows `rows` [B]."""
        for buf, value in ((self.logp, logp), (self.ids, ids), (self.hidden, hidden)):
            if buf is not None:
                assert value is not None, "a root state kept per row is written with every root"
                buf.index_copy_(0, rows, value.to(buf.dtype))

    def set(self, reqs: list[Req], logp: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """Store the states of `reqs` and mark them ready."""
        self.write(h2d([r.row for r in reqs], self.logp.device), logp, ids, hidden)
        self.mark(reqs)

    def mark(self, reqs: list[Req]) -> None:
        """`reqs` have states (written by a graph replay)."""
        self.ready.update(r.rid for r in reqs)

    def get(self, rows: torch.Tensor) -> RootState:
        """(logp [B, k], ids [B, k], hidden [B, H] or None) of table rows `rows` [B] (device)."""
        return self.logp[rows], self.ids[rows], self.hidden[rows] if self.hidden is not None else None
