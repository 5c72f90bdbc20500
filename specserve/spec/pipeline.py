"""Pipelined speculative steps: launch step k+1 before reading step k back.

A speculative step ends in a read-back (the accepted tokens) and the host's bookkeeping:
committing tokens, stop checks, freeing slots, the scheduler's turn, then building and
launching the next verify. At batch 1 the GPU idles through all of it, nearly as long as
the step's own GPU work. When EAGLE drafts ahead (eagle.py), everything the next verify
needs is on the device once a step is queued: the next trees, the committed slots in
the table, and each request's kv_len after the commit (from the draft-ahead
bookkeeping). So the next step is launched from those device values before the previous
one is read back, and the host does step k's bookkeeping while the GPU runs step k+1,
as SGLang's overlap scheduler does for its spec v2 workers (any top-k here).

A step may be left in flight when every request's walk runs on the device (greedy; or
seeded sampling, filters included, through the step graphs: step_graphs.py), has a full
tree, no logits processors (penalties, bias, grammar: the host processes each node) and
no logprobs, cannot reach the context length within two steps,
and the proposer drafts ahead (`eligible`, `SpecWorker._pipelines`).
The next speculative step over the same requests, or over those of them still running
(a request that step k ended is dropped from step k+1, below), with trees drafted ahead
for them, launches first and then reads the step in flight back; its kv_lens and trees
are the rows of the step in flight that it continues (`live_rows`). Anything else (a
plain step, a request added, an abort of a request it carries, a retraction) first
drains it (`SpecWorker.drain`). At batch 64 a request ends every few steps, and a drain
costs a whole step with nothing to overlap, so the step that ended a request is not
drained: its successor takes the other rows. A prefill may run while it is in flight: it touches only its own
requests' rows and slots, and the batch it adds drains the step before speculating.

Invariant while a step is in flight: req.kv_len, output_ids and the allocator are those
before it (the host lags one step), and the step's `kv_after` holds kv_len after its
commit, on the device. A request that step k ends (EOS, a stop string, max_new_tokens) was already given
step k+1's verify slots: `drop` frees them at once and its step-(k+1) outcome is never
read. Step k+1 wrote only its own slots and table positions past that request's final
kv_len, so the KV the request leaves to the prefix cache is untouched.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.core.request import Req
from specserve.engine.kv_manager import KVManager
from specserve.spec.accept import PendingAccept


@dataclass
class InFlightSpec:
    """A speculative step launched and not yet read back."""

    reqs: list[Req]  # in batch order
    slots: list[torch.Tensor]  # each request's N verify slots (host)
    pending: PendingAccept  # the greedy walk, on its way to the host
    kv_after: torch.Tensor  # [B] int64 kv_len after this step's commit, on the device
    graphed: bool = False  # a step-graph replay: its state is in the graph's buffers (step_graphs.py)
    dropped: set[int] = field(default_factory=set)  # requests whose outcome is never read

    def live_rows(self, reqs: list[Req]) -> list[int] | None:
        """This step's rows that a step over `reqs` continues, when `reqs` are exactly its
        requests not dropped, in order; None when they are not."""
        live = [i for i in range(len(self.reqs)) if i not in self.dropped]
        if len(live) != len(reqs) or any(self.reqs[i] is not r for i, r in zip(live, reqs)):
            return None
        return live

    def drop(self, i: int, kv: KVManager) -> None:
        """Request i ended on the step before this one: free its verify slots now."""
        kv.allocator.free(self.slots[i])
        self.dropped.add(i)

    @property
    def nodes(self) -> int:
        """N, the tree nodes verified per request (the main tree's or the batch tree's)."""
        return self.slots[0].numel()

    @property
    def all_dropped(self) -> bool:
        return len(self.dropped) == len(self.reqs)


def eligible(reqs: list[Req], depth: int, context_length: int, sampled: bool = False) -> bool:
    """Whether a step over `reqs` may be left in flight: greedy walks (or, with `sampled`,
    seeded sampling: step_graphs.py walks its Gumbel targets), full trees,
    no logprobs (the verify graph's logits are overwritten by the next step) and room in
    the context for two more steps' tokens, `depth` + 1 each (the host checks limits a step late; positions
    stay in range). A request near max_new_tokens may be left in flight: a step that ends
    it by length drops it from the next one, as an EOS does, and that wasted step costs
    less than the unpipelined steps its last tokens would otherwise take."""
    room = 2 * (depth + 1)
    for req in reqs:
        p = req.params
        if p.logprobs or p.processed:
            return False
        if not p.greedy and not sampled:
            return False
        if req.seq_len + room >= context_length:
            return False
    return True

