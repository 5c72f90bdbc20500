"""The NGRAM proposer behind the `Proposer` protocol: the matcher (proposer.py) keyed by request.

A request's match state goes when it leaves (finished, aborted or retracted); a retracted
request that resumes is registered again from scratch. A request whose match is too short
to pay at the governor's price is given no draft (gate.py).

With SPECSERVE_NGRAM_ON_DEVICE=1 (core/env.py; off by default until it measures faster on a
real model), where the worker pipelines (a GPU: `whole_step`, called when it does), batches
of up to `DEVICE_ROWS` requests draft on the device instead (lookup.py): chains from each
request's own tokens, drafted ahead from the walk (`DraftsAhead`), so a step is launched
before the previous one is read back. Larger batches keep the trie and its gate: a full
chain for every request costs a verify of B x N tokens, which a pipeline's saved host
time repays only at small batches.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specserve.core import env
from specserve.core.request import Req
from specserve.engine.speculation import Decoded
from specserve.spec.accept import GreedyWalk
from specserve.spec.drafts import Drafts
from specserve.spec.ngram.gate import MatchGate
from specserve.spec.ngram.lookup import DeviceLookup
from specserve.spec.ngram.proposer import NgramProposer
from specserve.spec.proposer import DraftsAhead, Proposer, Verified, WholeStep
from specserve.spec.tree.ahead import TreesAhead

if TYPE_CHECKING:
    from specserve.engine.kv_manager import KVManager
    from specserve.runner.model_runner import ModelRunner

DEVICE_ROWS = 8  # batches up to this many requests draft on the device when the worker pipelines


class NgramAdapter(Proposer, DraftsAhead):
    """NgramProposer (keyed by request id) behind the Proposer protocol.

    The prompt and committed tokens are indexed lazily, in order, from the request's own
    ids (`_indexed` counts what the trie has seen): the next time it drafts, or, once the
    governor has a price, before every decode step at batch 1 (`drafts_pay`: whether a
    draft would pay). Otherwise plain steps pay no trie updates (the dominant NGRAM cost at
    large batch; a batch of 64 MT-bench prompts is ~7000 of them before the first token)."""

    def __init__(self, ngram: NgramProposer) -> None:
        self.ngram = ngram
        self.max_nodes = ngram.num_draft_tokens
        self._indexed: dict[str, int] = {}
        self.gate = MatchGate()
        self._drafted_from: dict[str, int] = {}  # rid -> the match length its last draft rested on
        self.lookup: DeviceLookup | None = None  # set by whole_step when the worker pipelines
        self.trees_ahead = TreesAhead()

    def add_request(self, req: Req) -> None:
        self.ngram.add_request(req.rid, [])
        self._indexed[req.rid] = 0

    def remove_request(self, req: Req) -> None:
        """The request's match state goes; the trie keeps what it learned from it."""
        self._indexed.pop(req.rid, None)
        self._drafted_from.pop(req.rid, None)
        self.ngram.remove_request(req.rid)
        if self.lookup is not None:
            self.lookup.forget(req)

    def on_price(self, ratio: float | None) -> None:
        self.gate.price = ratio

    def propose(self, reqs: list[Req], budgets: list[int]) -> Drafts:
        if max(budgets) == 1:  # penalties only: no lookup, no catching up
            return Drafts.roots([r.last_id for r in reqs])
        if self._on_device(len(reqs)):
            ahead = self.trees_ahead.take(reqs, self.max_nodes)
            assert self.lookup is not None, "_on_device"
            return ahead if ahead is not None else self.lookup.draft(reqs)
        self._catch_up(reqs)
        gated = []
        for req, budget in zip(reqs, budgets):
            length = self.ngram.match_length(req.rid)
            if budget > 1 and self.gate.allows(length):
                self._drafted_from[req.rid] = length
                gated.append(budget)
            else:
                gated.append(1)
        return self.ngram.propose([r.rid for r in reqs], [r.last_id for r in reqs], gated)

    def drafts_pay(self, reqs: list[Req]) -> bool | None:
        """Whether a speculative step over `reqs` is expected to commit at least the price
        of one (the governor's, in plain steps) times the tokens a plain step gives (one a
        request), from each request's match (gate.py `expected`); None: no price yet.
        Indexes the host's ids first: during plain steps the trie keeps up, a step behind
        the device when the plain steps overlap. None too where the batch drafts on the
        device: the trie's match says nothing of those drafts, and the gate learns nothing
        from them; the governor's measured steps decide."""
        price = self.gate.price
        if price is None or self._on_device(len(reqs)):
            return None
        self._catch_up(reqs)
        return sum(self.gate.expected(self.ngram.match_length(r.rid)) for r in reqs) >= price * len(reqs)

    def _catch_up(self, reqs: list[Req]) -> None:
        """Index the tokens of `reqs` the trie has not seen (their host ids)."""
        for req in reqs:
            ids = req.all_ids
            if self._indexed[req.rid] < len(ids):
                self.ngram.on_tokens(req.rid, ids[self._indexed[req.rid]:])
                self._indexed[req.rid] = len(ids)

    def on_decoded(self, reqs: list[Req], step: Decoded) -> None:
        self.trees_ahead.clear()  # drafted before this token

    # -- drafting ahead on the device (lookup.py; spec/pipeline.py) ----------------------------
    def whole_step(self, runner: ModelRunner, kv: KVManager, max_bs: int) -> WholeStep | None:
        """The worker pipelines: small batches draft on the device from now on, where
        SPECSERVE_NGRAM_ON_DEVICE allows it (no whole-step graph either way)."""
        if not env.ngram_on_device():
            return None
        self.lookup = DeviceLookup(kv.table.table, self.max_nodes, self.ngram.max_window, self.ngram.min_window)
        return None

    def _on_device(self, bsz: int) -> bool:
        return self.lookup is not None and bsz <= DEVICE_ROWS

    def can_draft_ahead(self, bsz: int) -> bool:
        return self._on_device(bsz)

    def draft_ahead(self, reqs: list[Req], walk: GreedyWalk, features: torch.Tensor | None, slots: torch.Tensor,
                    trees: bool, row_start: torch.Tensor) -> torch.Tensor:
        assert self.lookup is not None, "can_draft_ahead"
        drafts, kv_after = self.lookup.draft_ahead(walk, slots, row_start)
        self.trees_ahead.clear()
        if trees:
            self.trees_ahead.hold(reqs, drafts)
        return kv_after

    def keep_ahead(self, reqs: list[Req], rows: list[int], index: torch.Tensor) -> None:
        self.trees_ahead.keep(reqs, rows, index)

    def has_drafted_ahead(self, reqs: list[Req]) -> bool:
        return self.trees_ahead.has(reqs)

    def on_verified(self, reqs: list[Req], verified: Verified) -> None:
        """What each draft earned goes to the gate; the committed tokens are indexed from
        all_ids at the next proposal (the trie drafts from host ids)."""
        for req, committed in zip(reqs, verified.committed):
            length = self._drafted_from.pop(req.rid, None)
            if length is not None:
                self.gate.record(length, len(committed))
