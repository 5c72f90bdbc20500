"""KV storage indexed by token slot, and the allocator that hands out slots.

A *slot* is one token's K and V in every layer. Slot 0 is a scratch slot: it is never
handed out, so padded rows of a batch can write there harmlessly. The pool knows nothing
about requests; `req_table.py` maps request positions to slots and `radix.py` shares
slots between requests. Draft models get their own `KVPool` addressed by the same slots.
"""
from __future__ import annotations

import math
import mmap

import torch


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros of `shape`. On the CPU they are fresh anonymous pages, which the kernel zeroes
    when first touched, so the slots a server never uses cost no memory (torch.zeros writes
    every page: a 32k-slot pool of the default model would hold 1.5 GB from the start)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    pages = mmap.mmap(-1, max(1, count * torch.empty((), dtype=dtype).element_size()))
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)  # the tensor keeps `pages`


class KVPool:
    """Per-layer K and V tensors, each [num_slots + 1, num_kv_heads, head_dim]."""

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_slots = num_slots
        shape = (num_slots + 1, num_kv_heads, head_dim)
        # Zeros, not empty: attention multiplies masked-out padding keys' values by a zero
        # weight, and 0 * NaN from recycled memory would poison real rows.
        self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([T, kv_heads, head_dim]) of T new tokens at `slots` ([T])."""
        self.k[layer][slots] = k
        self.v[layer][slots] = v

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class SlotAllocator:
    """Free-list of slots 1..num_slots (CPU int64 tensors; freeing is batched lazily)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.num_slots + 1, dtype=torch.int64)
        self._released: list[torch.Tensor] = []
        self._released_count = 0

    @property
    def available(self) -> int:
        return self._free.numel() + self._released_count

    def alloc(self, n: int) -> torch.Tensor | None:
        """Return n distinct free slots, or None (and change nothing) if there are fewer."""
        if n > self._free.numel() and self._released:
            self._free = torch.cat([self._free, *self._released])
            self._released, self._released_count = [], 0
        if n > self._free.numel():
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            # a copy: the caller's tensor may be a view of the request table (on CPU,
            # `.to("cpu")` of a table row is a view) whose row is reused before this lands
            self._released.append(slots.to("cpu", torch.int64, copy=True))
            self._released_count += slots.numel()
