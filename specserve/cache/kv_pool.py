"""KV storage indexed by token slot, and the allocator that hands out slots.

A *slot* is one token's K and V in every layer. Slot 0 is a scratch slot: it is never
handed out, so padded rows of a batch can write there harmlessly. The pool knows nothing
about requests; `req_table.py` maps request positions to slots and `radix.py` shares
slots between requests. Draft models get their own `KVPool` addressed by the same slots.

fp8 KV cache (--kv-cache-dtype fp8_e4m3): the pool stores float8_e4m3fn with one scale
for K and one for V (float32 scalars, 1.0 unless given, as SGLang and vLLM default them).
Stored = e4m3(clamp(x * (1 / scale), -448, 448)), rounded to nearest even; read =
stored * scale. Every writer (`write` here, the store kernels in kernels/rope.py and
kernels/qkv_rope.py) multiplies by the same float32 reciprocal, so all write the same
bytes; every reader (attention/) upcasts before its products.
"""
from __future__ import annotations

import collections
import functools
import math
import mmap

import torch

FP8_DTYPES = (torch.float8_e4m3fn,)  # what an fp8 pool may store (e5m2 is refused at start-up)
FP8_MAX = 448.0  # e4m3fn's largest finite value: stores saturate there
KV_CACHE_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn}  # --kv-cache-dtype, but auto


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


@functools.lru_cache(maxsize=64)  # a dict lookup per kernel launch, not a tensor round trip
def inverse_scale(scale: float) -> float:
    """1 / scale rounded to float32: the factor every KV writer multiplies by."""
    return float(torch.tensor(1.0 / scale, dtype=torch.float32))


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x as an fp8 pool of `dtype` stores it (module docstring); x unchanged otherwise."""
    if not is_fp8(dtype):
        return x
    return (x.float() * inverse_scale(scale)).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored values x back as `dtype`: stored * scale from an fp8 pool; x unchanged otherwise."""
    if not is_fp8(x.dtype):
        return x
    return (x.float() * scale).to(dtype)


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
    """Per-layer K and V tensors, each [num_slots + 1, num_kv_heads, head_dim] of `dtype`;
    k_scale / v_scale are the fp8 scales (unused by a pool of the model's dtype)."""

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        self.num_slots = num_slots
        self.dtype = dtype
        # float32 values, as the kernels receive them
        self.k_scale, self.v_scale = (float(torch.tensor(s, dtype=torch.float32)) for s in (k_scale, v_scale))
        shape = (num_slots + 1, num_kv_heads, head_dim)
        # Zeros, not empty: attention multiplies masked-out padding keys' values by a zero
        # weight, and 0 * NaN from recycled memory would poison real rows.
        self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([T, kv_heads, head_dim]) of T new tokens at `slots` ([T]), quantized
        in an fp8 pool."""
        self.k[layer][slots] = quantize(k, self.k_scale, self.dtype)
        self.v[layer][slots] = quantize(v, self.v_scale, self.dtype)

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one token in every layer: 1 byte an element in an fp8 pool."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


class SlotAllocator:
    """Free list of slots 1..num_slots (CPU int64 tensors).

    Slots freed since the last allocations are handed out again first, in the order they
    were freed, before any slot never used: a CPU pool's pages are mapped when first
    touched (`_zeros`), so a server keeps to the pages its peak load needs, and a step
    writes its K and V to pages that are mapped and cached rather than faulting on a fresh
    page every few tokens. Freeing appends a tensor; no step copies the whole free list."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.num_slots + 1, dtype=torch.int64)  # never handed out since clear
        self._released: collections.deque[torch.Tensor] = collections.deque()  # freed, oldest first
        self._released_count = 0

    @property
    def available(self) -> int:
        return self._free.numel() + self._released_count

    def alloc(self, n: int) -> torch.Tensor | None:
        """Return n distinct free slots, or None (and change nothing) if there are fewer."""
        if n > self.available:
            return None
        parts, need = [], n
        while need and self._released:
            head = self._released[0]
            if head.numel() <= need:
                parts.append(self._released.popleft())
            else:
                parts.append(head[:need])
                self._released[0] = head[need:]
            need -= parts[-1].numel()
        self._released_count -= n - need
        if need or not parts:  # (n == 0: an empty tensor)
            parts.append(self._free[:need])
            self._free = self._free[need:]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            # a copy: the caller's tensor may be a view of the request table (on CPU,
            # `.to("cpu")` of a table row is a view) whose row is reused before this lands
            self._released.append(slots.to("cpu", torch.int64, copy=True).reshape(-1))
            self._released_count += slots.numel()
