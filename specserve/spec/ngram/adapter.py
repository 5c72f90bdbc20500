"""The NGRAM proposer behind the `Proposer` protocol: the matcher (proposer.py) keyed by request.

The prompt and committed tokens are indexed lazily, in order, from the request's own ids
the next time it drafts, so steps the governor runs plainly pay no trie updates. A
request's match state goes when it leaves (finished, aborted or retracted); a retracted
request that resumes is registered again from scratch.
"""
from __future__ import annotations

from specserve.core.request import Req
from specserve.spec.drafts import Drafts
from specserve.spec.ngram.proposer import NgramProposer
from specserve.spec.proposer import Proposer, Verified


class NgramAdapter(Proposer):
    """NgramProposer (keyed by request id) behind the Proposer protocol.

    The prompt and committed tokens are indexed lazily, in order, from the request's own
    ids the next time it drafts (`_indexed` counts what the trie has seen). While the
    governor runs plain steps nothing drafts, so plain decoding pays no trie updates (the
    dominant NGRAM cost at large batch; a batch of 64 MT-bench prompts is ~7000 of them
    before the first token)."""

    def __init__(self, ngram: NgramProposer) -> None:
        self.ngram = ngram
        self.max_nodes = ngram.num_draft_tokens
        self._indexed: dict[str, int] = {}

    def add_request(self, req: Req) -> None:
        self.ngram.add_request(req.rid, [])
        self._indexed[req.rid] = 0

    def remove_request(self, req: Req) -> None:
        """The request's match state goes; the trie keeps what it learned from it."""
        self._indexed.pop(req.rid, None)
        self.ngram.remove_request(req.rid)

    def propose(self, reqs: list[Req], budgets: list[int]) -> Drafts:
        if max(budgets) == 1:  # penalties only: no lookup, no catching up
            return Drafts.roots([r.last_id for r in reqs])
        for req in reqs:
            ids = req.all_ids
            if self._indexed[req.rid] < len(ids):
                self.ngram.on_tokens(req.rid, ids[self._indexed[req.rid]:])
                self._indexed[req.rid] = len(ids)
        return self.ngram.propose([r.rid for r in reqs], [r.last_id for r in reqs], budgets)

    def on_verified(self, reqs: list[Req], verified: Verified) -> None:
        pass  # indexed from all_ids at the next proposal (the trie drafts from host ids)
