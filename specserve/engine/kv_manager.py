"""Request-level KV memory: rows, slots, prefix sharing, release and retraction.

Owns the slot allocator, the request-to-token table and the prefix cache, and keeps
them consistent. Every path that gives a request memory or takes it back goes through
here, so the leak check (`assert_no_leak`) can hold after every test:
free slots + slots owned by the prefix cache == all slots, no locks, every row free.
"""
from __future__ import annotations

import torch

from specserve.cache.kv_pool import SlotAllocator
from specserve.cache.radix import NoPrefixCache, RadixCache
from specserve.cache.req_table import ReqToTokenTable
from specserve.core.request import Req


class KVManager:
    # Tests set this: a release then checks the host twin of the table against the device's
    # row (a read that waits for the GPU, so never in serving).
    check_twin = False

    def __init__(self, num_slots: int, max_reqs: int, max_context: int, device: torch.device,
                 enable_prefix_cache: bool, prefix_backoff: int = 0) -> None:
        self.allocator = SlotAllocator(num_slots)
        # Cached-prefix tokens to recompute anyway: EAGLE's draft KV at the last cached
        # position was paired with whatever token followed it then (see spec/eagle/proposer.py).
        self.prefix_backoff = prefix_backoff
        self.table = ReqToTokenTable(max_reqs, max_context, device)
        cls = RadixCache if enable_prefix_cache else NoPrefixCache
        self.prefix_cache = cls(self.allocator)
        self.reserved = 0  # slots taken for good (`reserve`)

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots

    def available(self) -> int:
        """Slots that could be handed out now, evicting unlocked cached prefixes if needed."""
        return self.allocator.available + self.prefix_cache.evictable_size()

    def used(self) -> int:
        return self.num_slots - self.allocator.available - self.prefix_cache.evictable_size()

    def alloc_slots(self, n: int) -> torch.Tensor | None:
        if n > self.allocator.available:
            self.prefix_cache.evict(n - self.allocator.available)
        return self.allocator.alloc(n)

    def reserve(self, n: int) -> torch.Tensor:
        """n slots taken for the server's lifetime (CUDA-graph scratch: spec/eagle/step_graphs.py);
        the leak check counts them as owned."""
        slots = self.alloc_slots(n)
        if slots is None:
            raise RuntimeError(f"cannot reserve {n} KV slots: the pool has {self.available()}")
        self.reserved += n
        return slots

    def admit(self, req: Req) -> bool:
        """Give `req` a table row and borrow its longest cached prefix. False: no row free."""
        row = self.table.alloc()
        if row is None:
            return False
        # Keep at least one token to compute: its logits give the next token.
        slots, node = self.prefix_cache.match_prefix(req.all_ids[:-1])
        slots = slots[:max(0, slots.numel() - self.prefix_backoff)]  # node stays locked: a superset
        self.prefix_cache.lock(node)
        req.table_row, req.cache_node = row, node
        req.kv_len = req.cached_len = slots.numel()
        req.cached_tokens = max(req.cached_tokens, min(req.cached_len, len(req.prompt_ids)))
        if slots.numel():
            self.table.write(row, 0, slots)
        return True

    def extend(self, req: Req, n: int) -> torch.Tensor | None:
        """Allocate slots for positions [kv_len, kv_len+n) of `req` and advance kv_len."""
        slots = self.alloc_slots(n)
        if slots is None:
            return None
        self.table.write(req.row, req.kv_len, slots)
        req.kv_len += n
        return slots

    def alloc_each(self, counts: list[int]) -> list[torch.Tensor] | None:
        """counts[i] fresh slots for each i, from one allocation (None: not enough, nothing taken)."""
        slots = self.alloc_slots(sum(counts))
        return None if slots is None else list(slots.split(counts))

    def extend_each(self, reqs: list[Req]) -> torch.Tensor | None:
        """One new position per request (a decode step): slots for positions kv_len, one
        allocation and one table write for the whole batch, kv_len advanced. [B] slots."""
        slots = self.alloc_slots(len(reqs))
        if slots is None:
            return None
        self.table.write_each([r.row for r in reqs], [r.kv_len for r in reqs], slots)
        for req in reqs:
            req.kv_len += 1
        return slots

    def release(self, req: Req, cacheable: int | None = None) -> None:
        """Hand the request's KV to the prefix cache (or free it) and free its row;
        `cacheable`: only positions below it go to the cache (the rest are freed)."""
        if req.table_row is None:
            return
        slots = self.table.read(req.row, 0, req.kv_len)
        if self.check_twin:
            device = self.table.table[req.row, :req.kv_len].cpu()
            assert torch.equal(slots, device), f"table twin differs from the device row of {req}"
        n = req.kv_len if cacheable is None else max(req.cached_len, min(cacheable, req.kv_len))
        already = self.prefix_cache.insert(req.all_ids[:n], slots[:n])
        # slots[:cached_len] came from the cache itself; [cached_len:already] duplicate
        # tokens another request cached meanwhile: those copies are ours to free.
        self.allocator.free(slots[req.cached_len:already])
        self.allocator.free(slots[n:])
        self.prefix_cache.unlock(req.cache_node)
        self.table.free(req.row)
        req.table_row, req.cache_node, req.kv_len, req.cached_len = None, None, 0, 0

    def flush_cache(self) -> bool:
        return self.prefix_cache.flush()

    def assert_no_leak(self) -> None:
        assert self.prefix_cache.protected_size() == 0, "prefix cache still has locked nodes"
        assert self.table.available == self.table.max_reqs, "a table row is still in use"
        cached = self.prefix_cache.total_size()
        free = self.allocator.available
        assert free + cached + self.reserved == self.num_slots, \
            f"leak: {free} free + {cached} cached + {self.reserved} reserved != {self.num_slots}"
