"""The NGRAM proposer behind the `Proposer` protocol: the matcher (proposer.py) keyed by request.

A request's match state goes when it leaves (finished, aborted or retracted); a retracted
request that resumes is registered again from scratch. A request whose match is too short
to pay at the governor's price is given no draft (gate.py).
"""
from __future__ import annotations

from specserve.core.request import Req
from specserve.spec.drafts import Drafts
from specserve.spec.ngram.gate import MatchGate
from specserve.spec.ngram.proposer import NgramProposer
from specserve.spec.proposer import Proposer, Verified


class NgramAdapter(Proposer):
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

    def add_request(self, req: Req) -> None:
        self.ngram.add_request(req.rid, [])
        self._indexed[req.rid] = 0

    def remove_request(self, req: Req) -> None:
        """The request's match state goes; the trie keeps what it learned from it."""
        self._indexed.pop(req.rid, None)
        self._drafted_from.pop(req.rid, None)
        self.ngram.remove_request(req.rid)

    def on_price(self, ratio: float | None) -> None:
        self.gate.price = ratio

    def propose(self, reqs: list[Req], budgets: list[int]) -> Drafts:
        if max(budgets) == 1:  # penalties only: no lookup, no catching up
            return Drafts.roots([r.last_id for r in reqs])
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
        the device when the plain steps overlap."""
        price = self.gate.price
        if price is None:
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

    def on_verified(self, reqs: list[Req], verified: Verified) -> None:
        """What each draft earned goes to the gate; the committed tokens are indexed from
        all_ids at the next proposal (the trie drafts from host ids)."""
        for req, committed in zip(reqs, verified.committed):
            length = self._drafted_from.pop(req.rid, None)
            if length is not None:
                self.gate.record(length, len(committed))
