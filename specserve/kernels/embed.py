"""Token embedding lookup in one Triton launch: out[t] = weight[ids[t]].

A speculative step runs several forwards of a few rows each (the verify, the draft
extend, every drafting depth), and torch's index_select for their ids is a separate,
general kernel that, as a torch kernel, ends the programmatic-dependent-launch chain of
the Triton kernels around it. One program per token copies its row; an id outside [0, V) gives a zero row
(never a read out of bounds). EAGLE-3's drafting forwards launch none: their pair norm
gathers the rows itself (`norm.rms_norm_pair`'s ids).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl_flags
from specserve.kernels.pdl import wait_and_release


@triton.jit
def _embedding_kernel(ids_ptr, w_ptr, out_ptr, V, D, sw, so, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_and_release(USE_PDL)  # the ids may be the kernel before's output
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    row = tl.load(ids_ptr + t + d * 0).to(tl.int64)  # the id, once per column
    live = d < D
    x = tl.load(w_ptr + row * sw + d, mask=live & (row >= 0) & (row < V), other=0.0)
    tl.store(out_ptr + t * so + d, x, mask=live)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """ids [T] (any integer dtype) -> weight[ids] [T, D]."""
    v, d = weight.shape
    assert ids.dim() == 1 and weight.stride(1) == 1, (ids.shape, weight.stride())
    out = torch.empty(ids.shape[0], d, dtype=weight.dtype, device=weight.device)
    if ids.shape[0]:
        block = triton.next_power_of_2(d)
        _embedding_kernel[(ids.shape[0],)](ids, weight, out, v, d, weight.stride(0), out.stride(0), BLOCK=block,
                                           num_warps=4 if block >= 1024 else 1, **pdl_flags(weight.device))
    return out
