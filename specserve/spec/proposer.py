"""The Proposer protocol: what the speculative worker needs from a drafting method.

The worker knows nothing else about proposers, and nothing outside `spec/` knows about
proposers at all. Life cycle per request: `add_request` when it starts decoding,
`propose` / `on_verified` once per speculative step, `remove_request` when it finishes,
is aborted or is retracted (a retracted request is added again when it resumes).
"""
from __future__ import annotations

from typing import Protocol

from specserve.engine.request import Req
from specserve.spec.drafts import Drafts


class Proposer(Protocol):
    max_nodes: int  # N: tree nodes per request including the root (memory reservation)

    def add_request(self, req: Req) -> None: ...

    def remove_request(self, req: Req) -> None: ...

    def propose(self, reqs: list[Req], budgets: list[int]) -> Drafts:
        """Trees of at most budgets[b] nodes whose root is reqs[b].all_ids[-1].

        Called after the worker allocated `budgets[b]` verify slots per request and wrote
        them into the request's table row at positions [kv_len, kv_len + budget): a draft
        model may write its own KV for node i of a chain at position kv_len + i.
        """
        ...

    def on_verified(self, reqs: list[Req], committed: list[list[int]]) -> None:
        """The tokens each request committed this step (accepted drafts + bonus, possibly
        cut short by a finish); the request's kv_len already accounts for them."""
        ...


class NgramAdapter:
    """NgramProposer (keyed by request id) behind the Proposer protocol."""

    def __init__(self, ngram) -> None:
        self.ngram = ngram
        self.max_nodes = ngram.num_draft_tokens

    def add_request(self, req: Req) -> None:
        self.ngram.add_request(req.rid, req.all_ids)

    def remove_request(self, req: Req) -> None:
        self.ngram.remove_request(req.rid)

    def propose(self, reqs: list[Req], budgets: list[int]) -> Drafts:
        return self.ngram.propose([r.rid for r in reqs], [r.all_ids[-1] for r in reqs], budgets)

    def on_verified(self, reqs: list[Req], committed: list[list[int]]) -> None:
        for req, tokens in zip(reqs, committed):
            self.ngram.on_tokens(req.rid, tokens)
