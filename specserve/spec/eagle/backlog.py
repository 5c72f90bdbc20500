"""DraftBacklog: the draft extend of EAGLE's plain decode steps, deferred and batched.

After a plain decode step (the governor turned speculation down), EAGLE's draft KV lacks
the position the step fed, which pairs the target's feature there with the token the step
sampled (spec/eagle/proposer.py). Extending the draft by that one token every step would put
a graph replay and its inputs on the host's path at every plain step, and plain steps are
what the governor chose because they are cheaper. Instead a plain step only writes its
sampled tokens and the target's features at the fed positions into rings on the device
(`push`: two index copies, no forward), and the draft catches up over the whole run in one
extend (`take`) when speculation resumes, or when a request's backlog fills its ring. With CUDA
graphs that extend is a replay padded to W tokens a request (the catch-up graphs): eagerly,
each new ragged shape would compile attention kernels of its own while serving.

Layout: a request's backlog is the span [start, end) of positions fed by plain steps since
its draft KV was last computed. Position p of table row r lives in ring cell r * W + p % W
(W = `RING`): the feature at p and the token sampled after p. Invariant: a request's draft
KV is valid below `start` (everywhere, with no span). A request released with a backlog
hands the prefix cache its KV below `start` alone (`cacheable`): a later request borrowing
the rest would find no draft KV there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.cache.req_table import slots_at
from specserve.core.h2d import h2d_many
from specserve.core.request import Req
from specserve.engine.speculation import Decoded

RING = 16  # plain steps a request may run before its draft catches up


@dataclass
class CatchUp:
    """One draft extend over the backlogs of `reqs`: request b feeds positions
    [prefix_lens[b], prefix_lens[b] + extend_lens[b]), padded (when asked) to L tokens
    each. Device tensors [T]: ids (each position's next token), positions, slots and ring
    cells (rows of `DraftBacklog.features`); [B]: table rows and each request's last real
    token. Padding tokens (last in their request, so no real token attends to them) sit at
    position 0, in range whatever the context, and write the scratch slot 0."""

    reqs: list[Req]
    prefix_lens: list[int]
    extend_lens: list[int]
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    cells: torch.Tensor
    rows: torch.Tensor
    last: torch.Tensor


class DraftBacklog:
    def __init__(self, rows: int, width: int, dtype: torch.dtype, device: torch.device, ring: int = RING) -> None:
        self.ring = ring
        self.tokens = torch.zeros(rows * ring, dtype=torch.int64, device=device)
        self.features = torch.zeros(rows * ring, width, dtype=dtype, device=device)
        self.spans: dict[str, list[int]] = {}  # request id -> [start, end)
        # A kernel's first launch in a process loads its CUDA module, which a fresh
        # engine's first plain step would pay mid-traffic. Load `push`'s kernels now,
        # writing cell 0 with what it holds.
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        cells = zero.remainder(ring).add_(zero, alpha=ring)
        self.tokens.index_copy_(0, cells, self.tokens[:1].clone())
        self.features.index_copy_(0, cells, self.features[:1].clone())

    def push(self, reqs: list[Req], step: Decoded) -> bool:
        """Queue a plain step's fed positions (device writes only). Returns whether a
        request's ring is now full: the caller catches up before the next push."""
        assert step.features is not None, "EAGLE's runner captures features for plain steps too"
        cells = step.positions.remainder(self.ring).add_(step.rows, alpha=self.ring)
        self.tokens.index_copy_(0, cells, step.tokens)
        self.features.index_copy_(0, cells, step.features)
        full = False
        for req, p in zip(reqs, step.prefix_lens):
            span = self.spans.setdefault(req.rid, [p, p])
            assert span[1] == p, "a request's plain steps feed consecutive positions"
            span[1] = p + 1
            full = full or span[1] - span[0] == self.ring
        return full

    def take(self, reqs: list[Req], table: torch.Tensor, pad_to: int | None = None) -> CatchUp | None:
        """The catch-up of those of `reqs` with a backlog (cleared), or None when none has;
        `table` [rows, context] the slot table; `pad_to` L (>= RING) pads each request."""
        if not self.spans:
            return None
        behind = [(req, self.spans.pop(req.rid)) for req in reqs if req.rid in self.spans]
        if not behind:
            return None
        cells: list[int] = []
        flat: list[int] = []
        positions: list[int] = []
        last: list[int] = []
        stride = table.stride(0)
        for req, (start, end) in behind:
            n = end - start
            pad = (pad_to or n) - n
            cells += [req.row * self.ring + p % self.ring for p in range(start, end)] + [0] * pad
            flat += [req.row * stride + p for p in range(start, end)] + [-1] * pad
            positions += list(range(start, end)) + [0] * pad
            last.append(len(positions) - pad - 1)
        rows = [req.row for req, _ in behind]
        cells_t, flat_t, positions_t, rows_t, last_t = h2d_many([cells, flat, positions, rows, last],
                                                                self.tokens.device)
        return CatchUp([req for req, _ in behind], [s for _, (s, _) in behind], [e - s for _, (s, e) in behind],
                       self.tokens[cells_t], positions_t, slots_at(table, flat_t), cells_t, rows_t, last_t)

    def cacheable(self, req: Req) -> int | None:
        """How much of `req`'s KV the prefix cache may take: below its backlog, or all (None)."""
        span = self.spans.get(req.rid)
        return span[0] if span is not None else None

    def forget(self, req: Req) -> None:
        self.spans.pop(req.rid, None)
