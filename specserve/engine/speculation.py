"""What the engine knows of speculative decoding: a narrow interface, and nothing else.

Speculation lives a layer above the engine (`spec/`): the scheduler never imports it. Start-up
(`preflight.py`) asks the speculative registry for a `SpecPlan` and hands it down; the
scheduler sizes memory by its `SpecNeeds`, calls `build` once its runner and KV manager
exist, and from then on drives the `Speculator` it got through the methods below. No
algorithm name appears on this side of the interface.

Decode steps: before each one the scheduler asks `choose(reqs)`. Speculate: it makes room
(`slots_needed`, retracting requests if it must), drains a step in flight unless
`continues`, then calls `step`. Plain: it runs its own decode step and reports it with
`on_plain_step` (tokens still on the device). Prefill chunks are reported with
`on_extend`; requests enter with `admit` once their prefill is done and leave with
`release`, which says how much of their KV the prefix cache may keep.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from specserve.core.batch import ScheduleBatch
from specserve.core.request import Req

if TYPE_CHECKING:
    from specserve.engine.kv_manager import KVManager
    from specserve.runner.model_runner import ModelRunner


@dataclass(frozen=True)
class SpecNeeds:
    """What the engine sizes before the speculator exists."""

    draft_headroom_mb: int = 0  # GPU memory kept back for draft weights, trees and graphs
    # a draft's own KV per target slot: (layers, KV heads of the whole model, head dim)
    draft_kv_shape: tuple[int, int, int] | None = None
    prefix_backoff: int = 0  # cached-prefix positions to recompute when a prefix is borrowed
    verify_tokens: int = 0  # tree nodes a verify holds per request (table columns past kv_len)


@dataclass
class Decoded:
    """One plain decode step, as device tensors [B] (request order), before its read-back."""

    tokens: torch.Tensor  # the sampled tokens (position kv_len of each request, after this step)
    positions: torch.Tensor  # the position each request's root was fed at (kv_len - 1 after this step)
    slots: torch.Tensor  # the slot of that position
    rows: torch.Tensor  # table rows
    prefix_lens: list[int]  # positions, on the host
    features: torch.Tensor | None  # [B, F] target features at `positions`, when captured


class SpecStatsView(Protocol):
    @property
    def avg_accept_length(self) -> float | None:
        """Mean accept length since start (server info, /metrics), or None."""
        ...

    def take_window(self) -> float | None:
        """Mean accept length since the last call (the decode log line), or None."""
        ...


class Speculator(Protocol):
    """The scheduler's handle on speculative decoding (`spec/worker.py` SpecWorker)."""

    pipeline: bool  # leave steps in flight (set by the scheduler on CUDA with overlap on)

    @property
    def stats(self) -> SpecStatsView: ...

    @property
    def num_draft_tokens(self) -> int: ...

    @property
    def in_flight(self) -> bool:
        """Whether a step was launched and not yet read back."""
        ...

    def admit(self, req: Req) -> None:
        """`req` finished its prefill and decodes from now on."""

    def release(self, req: Req) -> int | None:
        """`req` finished, was aborted or retracted: forget it. Returns how many of its
        positions the prefix cache may keep (None: all)."""

    def choose(self, reqs: list[Req]) -> bool:
        """Whether the next decode step over `reqs` (the running requests) speculates."""

    def step(self, reqs: list[Req]) -> list[Req]:
        """One speculative step over `reqs`; the requests whose tokens were committed."""

    def drain(self) -> list[Req]:
        """Read back and commit the step in flight, if any; its requests."""

    def continues(self, reqs: list[Req]) -> bool:
        """Whether a step over `reqs` may launch with the current one still in flight."""

    def holds(self, req: Req) -> bool:
        """Whether the step in flight carries `req`."""

    def slots_needed(self, reqs: list[Req]) -> int:
        """Free KV slots one step over `reqs` takes at its peak."""

    def on_extend(self, batch: ScheduleBatch, features: torch.Tensor | None) -> None:
        """A target prefill chunk ran and was sampled."""

    def on_plain_step(self, reqs: list[Req], decoded: Decoded) -> None:
        """The scheduler ran a plain decode step (`choose` said so)."""

    def capture_graphs(self, max_bs: int) -> None:
        """Capture whatever CUDA graphs speculation replays, once the target's exist."""


class SpecPlan(Protocol):
    """A resolved speculative set-up (`spec/registry.py` Plan). Picklable: it crosses into
    the engine process, where `build` runs."""

    @property
    def needs(self) -> SpecNeeds: ...

    def build(self, runner: ModelRunner, kv: KVManager, eos_ids: frozenset[int], context_length: int,
              max_running: int) -> Speculator:
        """The speculator over this runner and KV manager."""
        ...
