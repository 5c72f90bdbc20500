"""The Proposer protocol: what the speculative worker needs from a drafting method.

The worker knows nothing else about proposers, and nothing outside `spec/` knows about
proposers at all. Life cycle per request: `add_request` when it starts decoding,
`propose` / `on_verified` once per speculative step (`on_decoded` instead for a step the
governor ran plainly: no proposal, one new token per request), `remove_request` when it
finishes, is aborted or is retracted (a retracted request is added again when it resumes).
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
    kv_slots: list[list[int]] | None = None
    extended: bool = False  # the proposer's draft_ahead already ran on this step's device paths


@dataclass
class Decoded:
    """One plain decode step, as device tensors [B] (request order), before its read-back."""

    tokens: torch.Tensor  # the sampled tokens (position kv_len of each request, after this step)
    positions: torch.Tensor  # the position each request's root was fed at (kv_len - 1 after this step)
    slots: torch.Tensor  # the slot of that position
    rows: torch.Tensor  # table rows
    prefix_lens: list[int]  # positions, on the host
    features: torch.Tensor | None  # [B, F] target features at `positions`, when captured


class Proposer(Protocol):
    max_nodes: int  # N: tree nodes per request including the root (memory reservation)
    scratch_per_req: int  # extra slots propose() may take per request (freed before verify)

    def add_request(self, req: Req) -> None: ...

    def remove_request(self, req: Req) -> None: ...

    def cacheable(self, req: Req) -> int | None:
        """Before `remove_request`: how much of `req`'s KV the prefix cache may take (the
        positions whose draft state a later request could borrow), or None for all."""
        ...

    def on_extend(self, batch: ScheduleBatch, features: torch.Tensor | None) -> None:
        """After a target EXTEND forward and its sampling: `features` [T, F] are the
        target's per-token features when the runner captures them (else None)."""
        ...

    def propose(self, reqs: list[Req], budgets: list[int]) -> Drafts:
        """Trees of at most budgets[b] nodes whose root is reqs[b].last_id.

        Called after the worker allocated `budgets[b]` verify slots per request and wrote
        them into the request's table row at positions [kv_len, kv_len + budget): a draft
        model may write its own KV for node i of a chain at position kv_len + i.
        """
        ...

    def on_verified(self, reqs: list[Req], verified: Verified) -> None:
        """After accept and commit: each request's kv_len already accounts for the
        committed tokens."""
        ...

    def on_decoded(self, reqs: list[Req], step: Decoded) -> None:
        """A plain decode step's forward and sampling are queued, not read back: the new
        tokens exist on the device only (req.all_ids lacks them), so a proposer can queue
        its own GPU work behind them while the host waits for the read-back."""
        ...

    def can_draft_ahead(self, bsz: int) -> bool:
        """Whether `draft_ahead` (EAGLE's; see eagle.py) can run for a batch of `bsz`: a
        proposer that says no is told of a step by `on_verified` alone."""
        ...

    def draft_ahead(self, reqs: list[Req], walk, features: torch.Tensor, slots: torch.Tensor, trees: bool,
                    row_start: torch.Tensor) -> torch.Tensor:
        """Where can_draft_ahead: on_verified's work (and with `trees` the next propose's)
        queued from a greedy walk (`accept.GreedyWalk`) on the device, before the verify is
        read back; slots and features [B, N, ...] are the verify's, row_start [2B] the
        requests' table rows then kv_lens, on the device. Returns the kv_lens [B] after the
        commit, on the device."""
        ...

    def keep_ahead(self, reqs: list[Req], rows: list[int], index: torch.Tensor) -> None:
        """Where has_drafted_ahead: the next propose is over `reqs`, rows `rows` (`index`
        on the device) of the requests drafted ahead, the others having ended."""
        ...

    def has_drafted_ahead(self, reqs: list[Req]) -> bool:
        """Where can_draft_ahead: whether the next propose over `reqs` takes trees that
        draft_ahead drafted (then it reads no host state: spec/pipeline.py)."""
        ...


class NgramAdapter:
    """NgramProposer (keyed by request id) behind the Proposer protocol.

    The prompt and committed tokens are indexed lazily, in order, from the request's own
    ids the next time it drafts (`_indexed` counts what the trie has seen). While the
    governor runs plain steps nothing drafts, so plain decoding pays no trie updates (the
    dominant NGRAM cost at large batch; a batch of 64 MT-bench prompts is ~7000 of them
    before the first token)."""

    scratch_per_req = 0

    def __init__(self, ngram) -> None:
        self.ngram = ngram
        self.max_nodes = ngram.num_draft_tokens
        self._indexed: dict[str, int] = {}

    def add_request(self, req: Req) -> None:
        self.ngram.add_request(req.rid, [])
        self._indexed[req.rid] = 0

    def remove_request(self, req: Req) -> None:
        self._indexed.pop(req.rid, None)

    def cacheable(self, req: Req) -> int | None:
        return None  # nothing of its own in the KV
        self.ngram.remove_request(req.rid)

    def on_extend(self, batch: ScheduleBatch, features: torch.Tensor | None) -> None:
        pass  # the prompt is indexed when the request first drafts

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
        pass  # indexed from all_ids at the next proposal

    def on_decoded(self, reqs: list[Req], step: Decoded) -> None:
        pass  # likewise

    def can_draft_ahead(self, bsz: int) -> bool:
        return False  # the trie drafts from host ids
