"""Host -> device index copies that never wait for the GPU, and the event a device -> host
read waits on (`ready_event`).

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
    # Every dispatched op costs host time, so conversions that change nothing are skipped:
    # at batch 1 a plain decode step is bound by its host work, not by its graph replay
    host = [_flat(p, dtype) for p in parts]
    flat = torch.cat(host).to(device, non_blocking=True)  # cat copies: never a view of a part
    return list(flat.split([h.numel() for h in host]))


def _flat(p, dtype: torch.dtype) -> torch.Tensor:
    """A part as a 1-D CPU tensor of `dtype`, converted only where it is not one already."""
    if not isinstance(p, torch.Tensor):
        return torch.tensor(p, dtype=dtype)
    p = p if p.dtype == dtype else p.to(dtype)
    return p if p.dim() == 1 else p.reshape(-1)


def ready_event(device: torch.device) -> torch.cuda.Event:
    """An event recorded now on `device`'s current stream: it fires once the work queued so
    far (a non_blocking copy to the host) is done. torch's `Event.record()` with no stream
    resolves the current device through a chain of Python helpers; with the device's index
    the stream lookup is one call, which matters on a host-bound step at batch 1."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device.index if device.index is not None else torch.cuda.current_device()))
    return event
