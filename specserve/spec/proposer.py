"""The Proposer protocol: what the speculative worker needs from a drafting method.

The worker knows nothing else about proposers, and nothing outside `spec/` knows about
proposers at all. Life cycle per request: `add_request` when it starts decoding,
`propose` / `on_verified` once per speculative step (`on_decoded` instead for a step the
governor ran plainly: no proposal, one new token per request), `remove_request` when it finishes,
is aborted or is retracted (a retracted request is added again when it resumes).
`on_extend` sees every target prefill chunk (EAGLE builds its draft KV from it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.engine.batch import ScheduleBatch
from specserve.engine.request import Req
from specserve.spec.drafts import Drafts


@dataclass
class Verified:
    """What one verify step decided, per request (in the step's request order)."""

    committed: list[list[int]]  # accepted drafts + bonus, possibly cut short by a finish
    paths: list[list[int]]  # tree nodes of the accepted path, root first; committed[b][i] follows paths[b][i]
    features: torch.Tensor | None  # [B, N, F] target features per tree node, when the proposer asked
    # per request, the slots now holding the committed positions [kv_len - len(committed), kv_len)
    kv_slots: list[torch.Tensor] | None = None


class Proposer(Protocol):
    max_nodes: int  # N: tree nodes per request including the root (memory reservation)
    scratch_per_req: int  # extra slots propose() may take per request (freed before verify)

    def add_request(self, req: Req) -> None: ...

    def remove_request(self, req: Req) -> None: ...

    def on_extend(self, batch: ScheduleBatch, features: torch.Tensor | None) -> None:
        """After a target EXTEND forward and its sampling: `features` [T, F] are the
        target's per-token features when the runner captures them (else None)."""
        ...

    def propose(self, reqs: list[Req], budgets: list[int]) -> Drafts:
        """Trees of at most budgets[b] nodes whose root is reqs[b].all_ids[-1].

        Called after the worker allocated `budgets[b]` verify slots per request and wrote
        them into the request's table row at positions [kv_len, kv_len + budget): a draft
        model may write its own KV for node i of a chain at position kv_len + i.
        """
        ...

    def on_verified(self, reqs: list[Req], verified: Verified) -> None:
        """After accept and commit: each request's kv_len already accounts for the
        committed tokens."""
        ...

    def on_decoded(self, reqs: list[Req], slots: torch.Tensor, features: torch.Tensor | None) -> None:
        """After a plain decode step: each request committed one token (its all_ids[-1]);
        slots [B] hold the KV of the position before it (kv_len - 1), features [B, F] the
        target's features there when the runner captures them."""
        ...


class NgramAdapter:
    """NgramProposer (keyed by request id) behind the Proposer protocol.

    Committed tokens are indexed lazily: they wait in `_pending` until the request next
    drafts. While the governor runs plain steps nothing drafts, so plain decoding pays
    no trie updates (the dominant NGRAM cost at large batch); the trie catches up, in
    order, before the next proposal."""

    scratch_per_req = 0

    def __init__(self, ngram) -> None:
        self.ngram = ngram
        self.max_nodes = ngram.num_draft_tokens
        self._pending: dict[str, list[int]] = {}

    def add_request(self, req: Req) -> None:
        self.ngram.add_request(req.rid, req.all_ids)

    def remove_request(self, req: Req) -> None:
        self._pending.pop(req.rid, None)
        self.ngram.remove_request(req.rid)

    def on_extend(self, batch: ScheduleBatch, features: torch.Tensor | None) -> None:
        pass  # the trie indexes the prompt in add_request

    def propose(self, reqs: list[Req], budgets: list[int]) -> Drafts:
        if max(budgets) == 1:  # a plain step: no lookup, no catching up
            return Drafts.roots([r.all_ids[-1] for r in reqs])
        for req in reqs:
            if req.rid in self._pending:
                self.ngram.on_tokens(req.rid, self._pending.pop(req.rid))
        return self.ngram.propose([r.rid for r in reqs], [r.all_ids[-1] for r in reqs], budgets)

    def on_verified(self, reqs: list[Req], verified: Verified) -> None:
        for req, tokens in zip(reqs, verified.committed):
            self._pending.setdefault(req.rid, []).extend(tokens)

    def on_decoded(self, reqs: list[Req], slots: torch.Tensor, features: torch.Tensor | None) -> None:
        for req in reqs:
            self._pending.setdefault(req.rid, []).append(req.all_ids[-1])
