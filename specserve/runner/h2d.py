"""Host -> device index copies that never wait for the GPU.

Indexing a CUDA tensor with a CPU index (or `.to(device)` without non_blocking) makes
PyTorch synchronise the stream after the copy, so every such op stalls the host until
all queued kernels finish. The speculative step issues dozens of small index ops; each
goes through here instead. A non_blocking copy from pageable memory is staged by the
driver before the call returns, so the host buffer may die at once.
"""
from __future__ import annotations

import torch


def h2d(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` (ints, a list of ints, or a CPU tensor) as a tensor on `device`, asynchronously."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return t.to(device=device, dtype=dtype, non_blocking=True)


def h2d_many(parts: list, device: torch.device, dtype: torch.dtype = torch.int64) -> list[torch.Tensor]:
    """Several index vectors in one copy (each copy is a launch): [len(p)] tensors on `device`."""
    host = [p if isinstance(p, torch.Tensor) else torch.tensor(p, dtype=dtype) for p in parts]
    flat = torch.cat([h.to(dtype).reshape(-1) for h in host]).to(device, non_blocking=True)
    return list(flat.split([h.numel() for h in host]))
