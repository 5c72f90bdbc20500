"""Private CPU memory in 2 MiB pages for the weights a CPU forward streams (kernels/cpu_quant.py's
tile layouts).

A decode step on the CPU reads every weight once, some 90 MB for the default model; in 4 KiB
pages that is some twenty thousand pages a step, each a TLB miss and a page walk that the
kernels' prefetches wait on. Linux backs an anonymous mapping with 2 MiB pages (transparent
huge pages) where `madvise(MADV_HUGEPAGE)` asks and the system allows it
(/sys/kernel/mm/transparent_hugepage/enabled: `always` or `madvise`); a file's mapping (the
layouts' file, which processes share through the page cache) gets none here. So a process
that serves a model alone may copy its layouts into such memory (`copy`); where it cannot,
the tensor is returned as it was.

Invariants: a copy holds the same bytes; tensors are packed one after another into chunks
of CHUNK bytes (a larger one gets a mapping of its own), each start 4096-aligned and each
chunk's first byte on a 2 MiB boundary; a chunk lives while any tensor in it does.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
from pathlib import Path

import torch

HUGE = 2 << 20  # bytes: one transparent huge page
CHUNK = 32 << 20  # bytes: the mappings small tensors share
ALIGN = 4096
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def available() -> bool:
    """Whether madvise(MADV_HUGEPAGE) can give this process huge pages."""
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and ("[always]" in setting or "[madvise]" in setting)


class _Chunk:
    def __init__(self, size: int) -> None:
        self.size = -(-size // HUGE) * HUGE
        self.map = mmap.mmap(-1, self.size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.start = -address % HUGE  # the first 2 MiB boundary in the mapping
        self.map.madvise(mmap.MADV_HUGEPAGE, self.start, self.size)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)[self.start:self.start + self.size]
        self.used = 0

    def take(self, n: int) -> torch.Tensor | None:
        """n bytes at the next aligned offset, or None if the chunk is too full."""
        if self.used + n > self.size:
            return None
        out = self.bytes[self.used:self.used + n]
        self.used = -(-(self.used + n) // ALIGN) * ALIGN
        return out


_open: list[_Chunk] = []  # the chunk small tensors go into now (at most one)


@torch.inference_mode(False)  # chunks outlive the call: never inference tensors, whoever asks first
def copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor `t` in huge-page memory; `t` itself where that is
    not available (a system without transparent huge pages, an empty tensor)."""
    if not available() or t.numel() == 0 or t.device.type != "cpu":
        return t
    src = t.contiguous().view(-1).view(torch.uint8)
    n = src.numel()
    if n > CHUNK // 4:
        out = _Chunk(n).take(n)
    else:
        out = _open[0].take(n) if _open else None
        if out is None:
            _open[:] = [_Chunk(CHUNK)]
            out = _open[0].take(n)
    assert out is not None, "a fresh chunk holds what it was sized for"
    out.copy_(src)
    return out.view(t.dtype).view(t.shape)
