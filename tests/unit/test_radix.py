"""Radix prefix cache: matching, splitting, locking, LRU eviction, slot ownership."""
from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.cache.kv_pool import SlotAllocator
from specserve.cache.radix import RadixCache


def _insert(cache: RadixCache, alloc: SlotAllocator, key: list[int]) -> torch.Tensor:
    prefix, node = cache.match_prefix(key)
    slots = torch.cat([prefix, alloc.alloc(len(key) - prefix.numel())])
    n = cache.insert(key, slots)
    alloc.free(slots[prefix.numel():n])
    return slots


def test_match_split_and_share():
    alloc = SlotAllocator(100)
    cache = RadixCache(alloc)
    a = _insert(cache, alloc, [1, 2, 3, 4, 5])
    b = _insert(cache, alloc, [1, 2, 3, 9])
    assert torch.equal(a[:3], b[:3])  # the shared prefix has the same slots
    slots, node = cache.match_prefix([1, 2, 3, 4, 7])
    assert torch.equal(slots, a[:4])
    assert cache.total_size() == 6
    assert alloc.available + cache.total_size() == 100


def test_locked_nodes_survive_eviction_and_lru_order():
    alloc = SlotAllocator(100)
    cache = RadixCache(alloc)
    _insert(cache, alloc, [1, 2, 3])
    _insert(cache, alloc, [7, 8])
    _insert(cache, alloc, [5, 6])
    _, node = cache.match_prefix([1, 2, 3])
    cache.lock(node)
    cache.match_prefix([5, 6])  # touch: [7, 8] is now least recently used
    assert cache.evict(2) == 2
    assert cache.match_prefix([7, 8])[0].numel() == 0
    assert cache.match_prefix([5, 6])[0].numel() == 2
    cache.evict(100)
    assert cache.match_prefix([1, 2, 3])[0].numel() == 3  # locked
    assert cache.protected_size() == 3
    cache.unlock(node)
    cache.evict(100)
    assert cache.total_size() == 0 and alloc.available == 100


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=12),
       st.integers(0, 40))
def test_random_inserts_keep_slot_accounting(keys, evict_n):
    alloc = SlotAllocator(200)
    cache = RadixCache(alloc)
    for key in keys:
        slots = _insert(cache, alloc, key)
        got, _ = cache.match_prefix(key)
        assert torch.equal(got, slots)
        assert alloc.available + cache.total_size() == 200
    cache.evict(evict_n)
    assert alloc.available + cache.total_size() == 200
    random.shuffle(keys)
    for key in keys:  # whatever survived still maps to distinct slots
        got, _ = cache.match_prefix(key)
        assert got.unique().numel() == got.numel()


def test_freed_slots_are_the_values_given_not_a_view():
    """The allocator keeps what free() was given even when the caller's tensor changes
    afterwards: on CPU a table row read is a view, and the row is reused by the next
    request (a freed row overwritten once put cached slots on the free list)."""
    from specserve.cache.req_table import ReqToTokenTable

    alloc = SlotAllocator(8)
    table = ReqToTokenTable(2, 8, torch.device("cpu"))
    row = table.alloc()
    table.write(row, 0, alloc.alloc(8))
    alloc.free(table.read(row, 0, 4))  # e.g. a released request's duplicate prefix slots
    freed = sorted(table.table[row, :4].tolist())
    table.free(row)
    table.write(table.alloc(), 0, torch.tensor([5, 6, 7, 8]))  # the row's next owner
    assert sorted(alloc.alloc(4).tolist()) == freed
