"""The greedy token of float32 logits rows on the CPU through cpu_rows.c (compiled with the
quantized kernels, kernels/cpu_quant.py): a batch-1 CPU step takes an argmax over a whole
vocabulary for its sample, and a speculative step one more a verified node and one over
the draft's vocabulary, each some 30-45 us through torch.

Invariant: `argmax(x)` equals `x.argmax(-1)`, first index among equal maxima; rows with a
NaN, other dtypes or devices, or a machine without the compiled library take torch's.
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
