"""Overlapped plain decoding: launch step k+1 before reading step k's tokens back.

Without overlap, a decode step's host work (picking the batch, allocating slots, building
index tensors, launching the graph, committing tokens) sits between two GPU steps, and
the GPU idles through it. With overlap the scheduler launches step k+1 first, feeding it
step k's sampled ids straight from the device (every other input is known on the host: a
decode step advances kv_len by one whatever the token), and only then reads step k's
tokens back, from a pinned copy queued right after step k's sampling, so the read waits
for step k and not for step k+1.

The price is one step of lag in what the host knows. A request whose step-k token ends
it (EOS, a stop string) was already given a step-(k+1) position: `InFlight.drop` gives
that slot back before the request is released, and its step-(k+1) token is never read.

Invariant while a step is in flight: each of its live requests has kv_len == seq_len (the
in-flight step is writing the KV of its last committed token) instead of seq_len - 1, and
the token it sampled is the next forward's input.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from specserve.core.h2d import h2d_many, ready_event
from specserve.core.request import Req
from specserve.engine.kv_manager import KVManager
from specserve.runner.sampler import SampleOutput


@dataclass
class InFlight:
    """A decode step launched and not yet read back."""

    reqs: list[Req]  # in batch order
    next_ids: torch.Tensor  # [B] sampled ids on the device: the next step's inputs
    host: SampleOutput  # the same outputs copied to (pinned) host memory, valid once `ready` fired
    slots: torch.Tensor  # [B] the slot each request's input token was given (host)
    ready: torch.cuda.Event | None  # None on CPU, where the copy was synchronous
    dropped: set[int] = field(default_factory=set)  # batch indices whose token is never read

    @staticmethod
    def launch(reqs: list[Req], so: SampleOutput, slots: torch.Tensor) -> InFlight:
        """Queue the device->host copy of `so` behind the step's sampling; do not wait."""
        copies: dict[str, Any] = {f.name: _to_host(getattr(so, f.name)) for f in fields(so)}
        host = SampleOutput(**copies)
        ready = None
        if so.next_ids.device.type == "cuda":
            ready = ready_event(so.next_ids.device)
        return InFlight(reqs, so.next_ids, host, slots, ready)

    def wait(self) -> SampleOutput:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host

    def index_of(self) -> dict[int, int]:
        """id(req) -> batch index, for the requests whose token is still to be read."""
        return {id(r): i for i, r in enumerate(self.reqs) if i not in self.dropped}

    def drop(self, i: int, kv: KVManager) -> None:
        """Request i ended on the previous step's token: give back the slot this step took
        for it (kv_len back to seq_len - 1, as after a plain step); its token is never read."""
        kv.allocator.free(self.slots[i:i + 1])
        self.reqs[i].kv_len -= 1
        self.dropped.add(i)

    @property
    def all_dropped(self) -> bool:
        return len(self.dropped) == len(self.reqs)


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    # non_blocking device->host copies land in pinned memory: the copy is queued, not waited on
    return None if t is None else t.to("cpu", non_blocking=True)


def select(so: SampleOutput, idx: list[int]) -> SampleOutput:
    """The rows `idx` of a host SampleOutput."""
    if idx == list(range(so.next_ids.shape[0])):
        return so
    rows = torch.tensor(idx, dtype=torch.int64)
    picked: dict[str, Any] = {f.name: None if (t := getattr(so, f.name)) is None else t[rows] for f in fields(so)}
    return SampleOutput(**picked)


def decode_inputs(reqs: list[Req], prev: InFlight | None, where: dict[int, int],
                  device: torch.device) -> list[int] | torch.Tensor:
    """Each request's next input token: from the in-flight step's device ids where it is
    in that step (`where` = prev.index_of()), else its last committed token (on the host)."""
    src = [where.get(id(r), -1) for r in reqs]
    if prev is None or all(s < 0 for s in src):
        return [r.last_id for r in reqs]
    if src == list(range(len(prev.reqs))):
        return prev.next_ids  # the same batch again: no index op at all
    src_t, host_t = h2d_many([src, [r.last_id if s < 0 else 0 for r, s in zip(reqs, src)]], device)
    return torch.where(src_t >= 0, prev.next_ids[src_t.clamp_min(0)], host_t)


def surely_ends(req: Req, context_length: int) -> bool:
    """The in-flight token of `req` ends it by length: a further step would be wasted."""
    return len(req.output_ids) + 1 >= req.max_new_tokens or req.seq_len + 1 >= context_length
