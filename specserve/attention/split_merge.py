"""Merging attention's key splits (flash-decoding): in the splitting launch itself, or after it.

Decode (`triton_decode.py`) and short extends (`triton_verify.py`) cut each row's keys
into NUM_SPLITS chunks, one program each; a split stores its normalised partial output
(fp32, [rows, heads, splits, dim]) and its log2-sum-exp ([rows, heads, splits]: -inf for a
split that saw no key, whose output it never writes). The merged output is
sum_s 2^lse_s o_s / sum_s 2^lse_s, added in split order (`_merge`).

`reduce_splits` merges them in a launch of its own, by default. With SPECSERVE_SPLIT_MERGE=1
(read at import) the splitting launch merges them itself (`count_in`): each program counts
itself in on a per-(program group) counter once its partials are stored, and the one
that counts NUM_SPLITS merges the group's rows, whoever came last, and sets the counter
back to 0 for the next launch, as the few-token products sum their K parts
(kernels/skinny.py `split_sum`). That saves a launch a layer but is slower a step
(docs/benchmarks.md): with programmatic dependent launch the separate merge starts early,
and the last split's atomic, barrier and merge lengthen the layer's critical path more
than the launch costs. More groups than counters take `reduce_splits`.

Launches on one stream never overlap where they count: with programmatic dependent
launch a kernel starts early but counts only after its wait, which waits for the kernel
before it to finish.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.triton_kernels import block_d
from specserve.core import env
from specserve.kernels import pdl_flags
from specserve.kernels.pdl import wait_and_release

MAX_COUNTED = 1 << 16  # program groups (all splits of the same rows) one launch may merge itself
FUSED_MERGE = env.split_merge_allowed()  # the last split merges (SPECSERVE_SPLIT_MERGE=1; else `reduce_splits`)
_COUNTS: dict[torch.device, torch.Tensor] = {}  # device -> the groups' counts, all 0 between launches


def split_counts(device: torch.device) -> torch.Tensor:
    """The device's counts of finished splits per program group: one zeroed buffer,
    allocated once so CUDA graphs keep its address; every launch leaves it 0."""
    if device not in _COUNTS:
        _COUNTS[device] = torch.zeros(MAX_COUNTED, dtype=torch.int32, device=device)
    return _COUNTS[device]


def fused(num_splits: int, groups: int) -> bool:
    """Whether a launch of `groups` program groups split `num_splits` ways merges itself."""
    return num_splits > 1 and FUSED_MERGE and groups <= MAX_COUNTED


@triton.jit
def _merge(o_rows, lse_rows, mask, stride_s, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The merged outputs [R, BLOCK_D] of R rows whose split 0 starts at o_rows [R] (their
    outputs; split s at + s * stride_s) and lse_rows [R] (their lse; split s at + s). An
    empty split weighs 0 and its output, never written, is dropped by a select (it may
    hold anything, NaN included). Read past L1 (.cg): the splits may be other SMs'
    programs of the same launch."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    every = mask[:, None] & (offs_s < NUM_SPLITS)[None, :]
    lse = tl.load(lse_rows[:, None] + offs_s[None, :], mask=every, other=float("-inf"), cache_modifier=".cg")
    top = tl.where(mask, tl.max(lse, 1), 0.0)  # a row past the real ones has no split: keep it finite
    acc = tl.zeros([o_rows.shape[0], BLOCK_D], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        ls = tl.load(lse_rows + s, mask=mask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(o_rows[:, None] + s * stride_s + offs_d[None, :], mask=mask[:, None] & mask_d[None, :],
                    other=0.0, cache_modifier=".cg")
        acc += tl.exp2(ls - top)[:, None] * tl.where((ls > float("-inf"))[:, None], o, 0.0)
    return acc / tl.where(mask, tl.sum(tl.exp2(lse - top[:, None]), 1), 1.0)[:, None]


@triton.jit
def count_in(o_rows, lse_rows, final_rows, mask, count_at, stride_s, NUM_SPLITS: tl.constexpr,
             BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """A split's end, its partials stored: count it in at count_at; the split that counts
    NUM_SPLITS merges the rows (`_merge`) into final_rows [R] (each row's output) and sets
    the count back to 0. The barrier puts every thread's stores before the counting
    atomic (acq_rel, GPU scope). BLOCK_S: NUM_SPLITS to the next power of 2."""
    tl.debug_barrier()
    if tl.atomic_add(count_at, 1, sem="acq_rel") == NUM_SPLITS - 1:
        o = _merge(o_rows, lse_rows, mask, stride_s, NUM_SPLITS, BLOCK_S, HEAD_DIM, BLOCK_D)
        offs_d = tl.arange(0, BLOCK_D)
        tl.store(final_rows[:, None] + offs_d[None, :], o.to(final_rows.dtype.element_ty),
                 mask=mask[:, None] & (offs_d < HEAD_DIM)[None, :])
        tl.store(count_at, 0)


@triton.jit
def _reduce_kernel(MidO, MidLse, Out, heads, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                   stride_ob, stride_oh, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    """out[b, h] for BLOCK_H heads of row b: `_merge` of their splits."""
    wait_and_release(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = h < heads
    out = _merge(MidO + b * stride_mb + h * stride_mh, MidLse + b * stride_lb + h * stride_lh, mask_h, stride_ms,
                 NUM_SPLITS, BLOCK_S, HEAD_DIM, BLOCK_D)
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(Out + b * stride_ob + h[:, None] * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=mask_h[:, None] & (offs_d < HEAD_DIM)[None, :])


def reduce_splits(mid: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, num_splits: int) -> None:
    """out [rows, H, D] from the splits' partial outputs mid [rows, H, S, D] and their
    log2-sum-exps lse [rows, H, S] (lse's split stride 1). A program takes as many heads
    of a row as fit in ~4k elements: one per (row, head) would give a large verify at a
    large batch tens of thousands of programs a layer, each with too few elements to pay
    for its scheduling."""
    rows, heads, dim = out.shape
    bd, bs = block_d(dim), triton.next_power_of_2(num_splits)
    bh = min(triton.next_power_of_2(heads), max(1, 4096 // (bs * bd)))
    _reduce_kernel[(rows, triton.cdiv(heads, bh))](
        mid, lse, out, heads, *mid.stride()[:3], *lse.stride()[:2], out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, BLOCK_S=bs, BLOCK_H=bh, HEAD_DIM=dim, BLOCK_D=bd, num_warps=4,
        **pdl_flags(out.device))
