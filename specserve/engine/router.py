"""Which data-parallel replica serves a request: prefix-cache affinity, bounded by load.

Each replica has its own radix cache, so a request whose prompt starts like one an
earlier request sent to replica d finds its prefix cached there. The router remembers,
for every block-aligned prefix of the prompts it routed (BLOCK tokens a block, at most
MAX_BLOCKS blocks), the replica it went to, and sends a request to the replica of its
longest remembered prefix, unless that replica carries more than SLACK requests beyond the
least loaded one: then, and for a prompt with nothing remembered, the least loaded
replica takes it (lowest index on ties). Load is the requests routed and not yet finished.
The memory is an LRU of at most `capacity` prefixes. The router holds no locks: it runs
on the HTTP server's event loop.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BLOCK = 32
MAX_BLOCKS = 64
SLACK = 4


class Router:
    def __init__(self, replicas: int, capacity: int = 100_000) -> None:
        self.loads = [0] * replicas
        self.routed = [0] * replicas  # requests ever routed to each replica
        self.capacity = capacity
        self._owner: OrderedDict[int, int] = OrderedDict()  # prefix hash -> replica

    def pick(self, ids: Sequence[int]) -> int:
        """The replica for a prompt `ids`; counts it in that replica's load."""
        keys = _prefix_keys(ids)
        least = min(range(len(self.loads)), key=lambda d: self.loads[d])
        choice = least
        for key in reversed(keys):  # longest remembered prefix first
            owner = self._owner.get(key)
            if owner is not None:
                if self.loads[owner] <= self.loads[least] + SLACK:
                    choice = owner
                break
        for key in keys:
            self._owner[key] = choice
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
        self.loads[choice] += 1
        self.routed[choice] += 1
        return choice

    def done(self, replica: int) -> None:
        """A request routed to `replica` finished (or was aborted)."""
        self.loads[replica] -= 1


def _prefix_keys(ids: Sequence[int]) -> list[int]:
    """A hash of each whole block-aligned prefix of `ids`, shortest first."""
    keys, h = [], 0
    for start in range(0, min(len(ids), BLOCK * MAX_BLOCKS) - BLOCK + 1, BLOCK):
        h = hash((h, tuple(ids[start:start + BLOCK])))
        keys.append(h)
    return keys
