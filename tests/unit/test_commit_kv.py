"""A speculative step's commit (spec/verify.py `commit_kv`): the kept nodes' slots land at
positions kv_len.. of the request's table row, the rest go back to the allocator, and a
request that kept a chain from its root (nodes 0 .. k-1, already where the step wrote its
verify slots) costs no table write."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from specserve.engine.kv_manager import KVManager
from specserve.spec.verify import commit_kv


def _step(kv: KVManager, reqs: list, n: int) -> list[torch.Tensor]:
    """The worker's step start: n verify slots a request, written in node order from kv_len."""
    slots = kv.alloc_each([n] * len(reqs))
    assert slots is not None
    kv.table.write_many([r.row for r in reqs], [r.kv_len for r in reqs], slots)
    return slots


def test_kept_nodes_land_in_path_order_and_chains_need_no_write(monkeypatch):
    kv = KVManager(256, 4, 64, torch.device("cpu"), False)
    reqs = [SimpleNamespace(row=kv.table.alloc(), kv_len=3 + b) for b in range(3)]
    free0 = kv.allocator.available
    slots = _step(kv, reqs, 6)
    # request 0 kept a chain from its root, 1 a branch (0 -> 2 -> 5), 2 its root alone
    paths, kept = [[0, 1, 2, 3], [0, 2, 5], [0]], [4, 3, 1]
    writes: list[list[int]] = []
    real = kv.table.write_many
    monkeypatch.setattr(kv.table, "write_many", lambda rows, starts, s: writes.append(list(rows)) or real(rows, starts, s))
    before = [r.kv_len for r in reqs]
    out = commit_kv(kv, reqs, slots, paths, kept, in_node_order=True)
    assert writes == [[reqs[1].row]]  # the branch alone moved slots
    for b, req in enumerate(reqs):
        want = [int(slots[b][i]) for i in paths[b][:kept[b]]]
        assert out[b] == want
        assert req.kv_len == before[b] + kept[b]
        for table in (kv.table.table, kv.table.host):
            assert table[req.row, before[b]:req.kv_len].tolist() == want
    assert kv.allocator.available == free0 - sum(kept)  # every other verify slot is free again


def test_without_the_step_write_every_request_is_written(monkeypatch):
    kv = KVManager(256, 4, 64, torch.device("cpu"), False)
    reqs = [SimpleNamespace(row=kv.table.alloc(), kv_len=0) for _ in range(2)]
    slots = kv.alloc_each([4, 4])
    assert slots is not None
    writes: list[list[int]] = []
    real = kv.table.write_many
    monkeypatch.setattr(kv.table, "write_many", lambda rows, starts, s: writes.append(list(rows)) or real(rows, starts, s))
    commit_kv(kv, reqs, slots, [[0, 1], [0, 1, 2]], [2, 3])
    assert writes == [[reqs[0].row, reqs[1].row]]
    for b, req in enumerate(reqs):
        assert kv.table.table[req.row, :req.kv_len].tolist() == slots[b][:req.kv_len].tolist()
