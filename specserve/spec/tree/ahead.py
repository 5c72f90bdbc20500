"""TreesAhead: the next step's trees, drafted ahead on the device, held for its propose.

A proposer that drafts ahead (spec/proposer.py `DraftsAhead`: EAGLE, STANDALONE, NGRAM on the device) queues
the next step's trees before the step that committed their roots is read back. They are
valid for one propose only, over exactly the requests they were drafted for, in order
(or a subset of them, kept by `keep` when some ended); anything that changes a request's
root first (a plain step, a retraction) drops them (`clear`).
"""
from __future__ import annotations

import torch

from specserve.core.request import Req
from specserve.spec.drafts import Drafts


class TreesAhead:
    def __init__(self) -> None:
        self._held: tuple[list[str], Drafts] | None = None  # (request ids, their trees)

    def hold(self, reqs: list[Req], drafts: Drafts) -> None:
        """`drafts` are the next trees of `reqs`."""
        self._held = ([r.rid for r in reqs], drafts)

    def clear(self) -> None:
        self._held = None

    def has(self, reqs: list[Req]) -> bool:
        """Whether the next propose over `reqs` takes held trees (then it reads no host state)."""
        return self._held is not None and self._held[0] == [r.rid for r in reqs]

    def keep(self, reqs: list[Req], rows: list[int], index: torch.Tensor) -> None:
        """The next propose is over `reqs`, rows `rows` (`index` on the device) of the
        requests drafted for, the others having ended."""
        assert self._held is not None, "trees were drafted ahead"
        rids, drafts = self._held
        assert [rids[i] for i in rows] == [r.rid for r in reqs], "continues the requests drafted ahead"
        self._held = ([r.rid for r in reqs], drafts.select(rows, index))

    def take(self, reqs: list[Req], nodes: int) -> Drafts | None:
        """The held trees when they are those of `reqs` with `nodes` nodes each; they are
        dropped either way (one propose only)."""
        held, self._held = self._held, None
        if held is None or held[0] != [r.rid for r in reqs] or held[1].num_nodes != nodes:
            return None
        return held[1]
