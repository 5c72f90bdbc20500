"""What the speculative worker needs from a drafting method: `Proposer`, and one optional
capability, `DraftsAhead`.

The worker (`worker.py`) knows nothing else about proposers, and nothing outside `spec/`
knows about proposers at all (the engine sees `worker.py` through engine/speculation.py).

Life cycle per request: `add_request` once its prefill is done, then per speculative step
`propose` and `on_verified`, and `remove_request` when it finishes, is aborted or is
retracted (a retracted request is added again when it resumes). Observation hooks with
do-nothing defaults: `on_extend` sees every target prefill chunk (EAGLE builds its draft KV
from it), `on_decoded` every plain decode step the governor chose, `on_price` what a
speculative step costs before each decode step (and `drafts_pay` whether drafting would
pay, where the proposer can tell), and `cacheable` how much of a leaving
request's KV the prefix cache may keep.

`DraftsAhead` is pipelined drafting on the device (EAGLE's and STANDALONE's): the next step's drafts are
queued from the verify's accepted paths before the host reads the verify back, so the
worker can launch step k+1 before it commits step k (pipeline.py). The worker checks for
it once, with isinstance; a proposer without it is told of each step by `on_verified`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from specserve.core.batch import ScheduleBatch
from specserve.core.request import Req
from specserve.engine.speculation import Decoded
from specserve.spec.drafts import Drafts

if TYPE_CHECKING:
    from specserve.engine.kv_manager import KVManager
    from specserve.runner.model_runner import ModelRunner
    from specserve.spec.accept import GreedyWalk


@dataclass
class Verified:
    """What one verify step decided, per request (in the step's request order)."""

    committed: list[list[int]]  # accepted drafts + bonus, possibly cut short by a finish
    paths: list[list[int]]  # tree nodes of the accepted path, root first; committed[b][i] follows paths[b][i]
    features: torch.Tensor | None  # [B, N, F] target features per tree node, when the proposer asked
    # per request, the slots now holding the committed positions [kv_len - len(committed), kv_len)
    kv_slots: list[list[int]] | None = None
    extended: bool = False  # the proposer's draft_ahead already ran on this step's device paths


class Proposer(ABC):
    """A drafting method: trees of candidate tokens below each request's root."""

    max_nodes: int  # N: tree nodes per request, the root included (verify slots reserved per step)
    scratch_per_req: int = 0  # extra slots `propose` may take per request (freed before verify)

    @abstractmethod
    def add_request(self, req: Req) -> None:
        """`req` decodes from now on (its prefill is done)."""

    @abstractmethod
    def propose(self, reqs: list[Req], budgets: list[int]) -> Drafts:
        """Trees of at most budgets[b] nodes whose root is reqs[b].last_id.

        Called after the worker allocated `budgets[b]` verify slots per request and wrote
        them into the request's table row at positions [kv_len, kv_len + budget): a draft
        model may write its own KV for node i of a chain at position kv_len + i.
        """

    @abstractmethod
    def on_verified(self, reqs: list[Req], verified: Verified) -> None:
        """After accept and commit: each request's kv_len already counts the committed tokens."""

    @abstractmethod
    def remove_request(self, req: Req) -> None:
        """`req` finished, was aborted or retracted: forget everything kept for it."""

    def cacheable(self, req: Req) -> int | None:
        """Before `remove_request`: how much of `req`'s KV the prefix cache may take (the
        positions whose draft state a later request could borrow), or None for all."""
        return None

    def on_price(self, ratio: float | None) -> None:
        """Before each decode step (so before its `propose`): what a speculative step costs
        in plain steps at this batch size (the governor's measurement; None: not measured,
        or not given at this batch size). A proposer that can tell how well
        a request's draft will do before drafting it may leave out drafts that will not
        pay (a budget of one node: the step decodes that request)."""

    def drafts_pay(self, reqs: list[Req]) -> bool | None:
        """Before a decode step, after `on_price`: whether drafting for `reqs` now would pay,
        when the proposer can tell without drafting; None (the default): it cannot, the
        governor decides alone. Host state may lag the device by a step (an overlapped plain
        step's tokens are not read back yet): the answer is a forecast, never a draft."""
        return None

    def on_extend(self, batch: ScheduleBatch, features: torch.Tensor | None) -> None:
        """After a target EXTEND forward and its sampling: `features` [T, F] are the
        target's per-token features when the runner captures them (else None)."""

    def on_decoded(self, reqs: list[Req], step: Decoded) -> None:
        """A plain decode step's forward and sampling are queued, not read back: the new
        tokens exist on the device only (req.all_ids lacks them), so a proposer can queue
        its own GPU work behind them while the host waits for the read-back."""


class WholeStep(Protocol):
    """A whole pipelined step as one CUDA graph per batch size (eagle/step_graphs.py)."""

    def can_run(self, bsz: int) -> bool: ...

    def nodes(self, bsz: int) -> int:
        """N, the tree nodes a step over `bsz` requests verifies per request."""
        ...

    def launch(self, reqs: list[Req], slots: torch.Tensor, first: Drafts | None) -> torch.Tensor:
        """Queue one step (and hand its proposer the next trees); the walk's packed rows
        [B, 2N + 1] on the device."""
        ...

    def keep_rows(self, b: int, rows: torch.Tensor) -> None: ...

    def kv_after(self, b: int) -> torch.Tensor: ...


class DraftsAhead(ABC):
    """Optional capability: drafting queued on the device behind a verify (module docstring)."""

    @abstractmethod
    def can_draft_ahead(self, bsz: int) -> bool:
        """Whether `draft_ahead` can run for a batch of `bsz`."""

    @abstractmethod
    def draft_ahead(self, reqs: list[Req], walk: GreedyWalk, features: torch.Tensor | None, slots: torch.Tensor,
                    trees: bool, row_start: torch.Tensor) -> torch.Tensor:
        """on_verified's work (and with `trees` the next propose's) queued from a greedy
        walk on the device, before the verify is read back; slots and features [B, N, ...]
        are the verify's (features None unless the runner captures them: a draft LLM),
        row_start [2B] the requests' table rows then kv_lens, on the device. Returns the
        kv_lens [B] after the commit, on the device."""

    @abstractmethod
    def keep_ahead(self, reqs: list[Req], rows: list[int], index: torch.Tensor) -> None:
        """The next propose is over `reqs`, rows `rows` (`index` on the device) of the
        requests drafted ahead, the others having ended."""

    @abstractmethod
    def has_drafted_ahead(self, reqs: list[Req]) -> bool:
        """Whether the next propose over `reqs` takes trees drafted ahead (then it reads no
        host state: pipeline.py)."""

    def whole_step(self, runner: ModelRunner, kv: KVManager, max_bs: int) -> WholeStep | None:
        """Graphs of the whole pipelined step for batches up to `max_bs`, where this
        proposer can draft inside them; None otherwise."""
        return None
