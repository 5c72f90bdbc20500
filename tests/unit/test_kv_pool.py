"""The KV pool on the CPU costs memory only for the slots that are written.

A server's pool is sized for many requests (the default model's 32k slots take 1.5 GB in
fp32), but torch.zeros writes every page. The pool's zeros are fresh anonymous pages
instead, zero until first touched, so an idle or lightly used server holds what it uses;
and the slot allocator hands freed slots out again before untouched ones, so a server
keeps to the pages its peak load needed.
"""
from __future__ import annotations

import torch

from specserve.cache.kv_pool import KVPool, SlotAllocator


def _rss_mb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) // 1024


def test_an_untouched_cpu_pool_takes_no_memory():
    before = _rss_mb()
    pool = KVPool(65536, 8, 4, 64, torch.float32, "cpu")  # 2 * 8 * 65537 * 4 * 64 * 4 bytes: 1 GiB
    assert pool.k[0].shape == (65537, 4, 64) and pool.k[0].dtype == torch.float32
    assert _rss_mb() - before < 64
    slots = torch.tensor([1, 7, 65536])
    pool.write(3, slots, torch.ones(3, 4, 64), torch.full((3, 4, 64), 2.0))
    assert _rss_mb() - before < 64  # three slots written: a few pages
    assert pool.k[3][slots].eq(1).all() and pool.v[3][slots].eq(2).all()
    assert pool.k[3][:7].sum() == 4 * 64 and pool.k[2][::4096].abs().sum() == 0  # zeros elsewhere


def test_freed_slots_come_back_before_untouched_ones():
    alloc = SlotAllocator(100)
    first = alloc.alloc(10)
    assert first.tolist() == list(range(1, 11))
    alloc.free(first[2:5])
    alloc.free(torch.tensor([[9], [1]]))  # any shape, and in the order freed
    assert alloc.available == 95
    assert alloc.alloc(2).tolist() == [3, 4]
    assert alloc.alloc(4).tolist() == [5, 9, 1, 11]  # the rest of the freed, then untouched
    assert alloc.alloc(0).numel() == 0 and alloc.available == 89
    assert alloc.alloc(90) is None and alloc.available == 89  # too many: nothing changes
    rest = alloc.alloc(89)
    assert sorted(rest.tolist()) == list(range(12, 101)) and alloc.available == 0


def test_a_steady_load_stays_on_the_same_pages():
    alloc = SlotAllocator(32768)
    seen: set[int] = set()
    held = torch.empty(0, dtype=torch.int64)
    for step in range(2000):  # a request of 300 slots at a time, each step one slot in and one out
        if step % 300 == 0:  # the request ends, the next begins
            alloc.free(held)
            held = alloc.alloc(300)
        new = alloc.alloc(1)
        alloc.free(held[:1])
        held = torch.cat([held[1:], new])
        seen.update(held.tolist())
    assert max(seen) <= 301  # never past the peak: every slot freed is used again
    alloc.free(held)
    assert alloc.available == 32768
