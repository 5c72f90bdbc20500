"""The greedy token of float32 logits rows on the CPU through cpu_rows.c (compiled with the
quantized kernels, kernels/cpu_quant.py): a batch-1 CPU step takes an argmax over a whole
vocabulary for its sample, and a speculative step one more a verified node and one over
the draft's vocabulary (with its log-probability: `top1`), each some 30-45 us through torch.

Invariant: `argmax(x)` equals `x.argmax(-1)`, first index among equal maxima; rows with a
NaN, other dtypes or devices, or a machine without the compiled library take torch's.
`top1` gives the same index and log_softmax's value there within float32 rounding.
"""
from __future__ import annotations

import torch

from specserve.kernels import cpu_quant


def argmax(x: torch.Tensor) -> torch.Tensor:
    """int64 argmax over the last dim of x (any leading shape), as torch.argmax(-1)."""
    lib = cpu_quant.library() if x.device.type == "cpu" and x.dtype == torch.float32 else None
    if lib is None or x.numel() == 0 or x.shape[-1] == 0:
        return x.argmax(-1)
    v = x.shape[-1]
    rows = x if x.is_contiguous() else x.contiguous()
    out = torch.empty(x.shape[:-1], dtype=torch.int64)
    lib.rows_argmax(rows.data_ptr(), rows.numel() // v, v, out.data_ptr())
    if out.numpy().min() < 0:  # a NaN: torch ranks it first
        return x.argmax(-1)
    return out


def top1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(log-probability [..., 1] float32, index [..., 1] int64) of each row's argmax over the
    last dim of x, as (x.log_softmax(-1) gathered there, x.argmax(-1)); None where the
    compiled library does not serve x (then ask torch)."""
    lib = cpu_quant.library() if x.device.type == "cpu" and x.dtype == torch.float32 else None
    if lib is None or x.numel() == 0 or x.shape[-1] == 0:
        return None
    v = x.shape[-1]
    rows = x if x.is_contiguous() else x.contiguous()
    idx = torch.empty((*x.shape[:-1], 1), dtype=torch.int64)
    logp = torch.empty((*x.shape[:-1], 1), dtype=torch.float32)
    lib.rows_top1(rows.data_ptr(), rows.numel() // v, v, idx.data_ptr(), logp.data_ptr())
    if idx.numpy().min() < 0:  # a NaN
        return None
    return logp, idx
