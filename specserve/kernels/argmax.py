"""The argmax of logits rows, in chunks over many programs: a verify's greedy targets, and
seeded sampling's Gumbel-max draw without its noise ever stored.

Program (r, c) takes chunk c of row r and writes its maximum and that maximum's first
index into [r, c]; a row's argmax is then the first index among its chunks' maxima (the
greedy walk, walk.py, reduces them for every node of a tree; `argmax` here with one small
launch). Torch's argmax runs one block per row, which leaves most of the GPU idle for a
verify's few long rows; chunked, a 32-row verify over a 49152-token vocabulary runs on
384 programs.

With `Tempered` rows the chunk takes the maximum of logits / T + g instead, g the seeded
Gumbel noise of the row's (seed, output index) drawn in registers (gumbel.gumbel_at), so
sampling at temperature T is one pass over the logits; with floors (filters.py: top-k, top-p
and min-p) the logits below a row's floor are left out of its draw. The torch path (runner.sampler.sample,
spec.accept.gumbel_targets; it runs everywhere else) writes the noise [R, V], then the
scaled logits, their sum with the noise and a where over greedy rows, and takes their
argmax: at batch 1 about eight launches a plain sampled step, and at a verify several
full passes over [R, V] float32 buffers inside the step graph. The division rounds as torch's does
(div_rn) and ties go to the first index as in torch, so a draw here equals that path's
on the same noise, and plain and speculative sampling stay token-identical under a seed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import Tempered, pdl_flags
from specserve.kernels.gumbel import gumbel_at
from specserve.kernels.pdl import wait_and_release

CHUNK = 4096  # logits per program


@triton.jit
def _chunks_kernel(x_ptr, val_ptr, idx_ptr, temp_ptr, greedy_ptr, seed_ptr, counter_ptr, floor_ptr, V, stride_x,
                   C, PER_REQ, BLOCK: tl.constexpr, TEMPERED: tl.constexpr, FLOORED: tl.constexpr,
                   USE_PDL: tl.constexpr):
    """Program (r, c): the max of row r's chunk c (tempered and perturbed where TEMPERED
    and r's request samples; logits below the row's floor left out where FLOORED) and its
    first index, into [r, c]."""
    wait_and_release(USE_PDL)  # the logits are the kernel before's
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    live = cols < V
    x = tl.load(x_ptr + r * stride_x + cols, mask=live, other=float("-inf")).to(tl.float32)
    if TEMPERED:
        q = r // PER_REQ
        if tl.load(greedy_ptr + q) == 0:
            # the temperature as a block (div_rn takes operands of one shape), floored as
            # runner.sampler.temperatures floors it
            t = tl.maximum(tl.load(temp_ptr + q + tl.zeros([BLOCK], dtype=tl.int64)), 1e-5)
            g = gumbel_at(tl.load(seed_ptr + q).to(tl.int64), tl.load(counter_ptr + r).to(tl.int64), cols)
            if FLOORED:
                live = live & (x >= tl.load(floor_ptr + r))
            x = tl.where(live, tl.math.div_rn(x, t) + g, float("-inf"))
    best, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + r * C + c, best)
    tl.store(idx_ptr + r * C + c, (c * BLOCK + i).to(tl.int64))


@triton.jit
def first_of_maxima(val_ptr, idx_ptr, rows, C, live, BLOCK_C: tl.constexpr):
    """Per row of `rows` [R] (where `live`): the first index among its C chunks' maxima;
    0 for a row of NaNs (no maximum matches 2**62, past every vocabulary)."""
    c = tl.arange(0, BLOCK_C)
    part = rows[:, None] * C + c[None, :]
    pmask = live[:, None] & (c < C)[None, :]
    pval = tl.load(val_ptr + part, mask=pmask, other=float("-inf"))
    pidx = tl.load(idx_ptr + part, mask=pmask, other=2**62)
    first = tl.min(tl.where(pval == tl.max(pval, axis=1)[:, None], pidx, 2**62), axis=1)
    return tl.where(first == 2**62, 0, first)


@triton.jit
def _pick_kernel(val_ptr, idx_ptr, out_ptr, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                 USE_PDL: tl.constexpr):
    wait_and_release(USE_PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < R
    tl.store(out_ptr + rows, first_of_maxima(val_ptr, idx_ptr, rows, C, live, BLOCK_C), mask=live)


def chunk_maxima(logits: torch.Tensor, tempered: Tempered | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] (unit stride along V) -> (maxima float32 [R, C], first indices int64
    [R, C]) of its C = ceil(V / CHUNK) chunks; with `tempered`, of logits / T + Gumbel
    noise on the sampled requests' rows."""
    rows, v = logits.shape
    chunks = triton.cdiv(v, CHUNK)
    val = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
    if rows:
        t = tempered
        if t is None:
            params, per_request = (val, val, idx, idx), 1  # unread: TEMPERED is off
        else:
            assert t.counters.numel() == rows and t.seeds.numel() * t.per_request == rows, "one key per row"
            params, per_request = (t.temperature, t.greedy, t.seeds, t.counters), t.per_request
        floors = t.floors if t is not None else None
        _chunks_kernel[(rows, chunks)](logits, val, idx, *params, val if floors is None else floors, v,
                                       logits.stride(0), chunks, per_request, BLOCK=CHUNK, TEMPERED=t is not None,
                                       FLOORED=floors is not None, num_warps=4, **pdl_flags(logits.device))
    return val, idx


def argmax(logits: torch.Tensor, tempered: Tempered | None = None) -> torch.Tensor:
    """[R] int64: each row's argmax (first on ties), of logits / T + noise where
    `tempered` says so, in two launches."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    val, idx = chunk_maxima(logits, tempered)
    rows, chunks = val.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        block_r = 16
        _pick_kernel[(triton.cdiv(rows, block_r),)](val, idx, out, rows, chunks, BLOCK_R=block_r,
                                                    BLOCK_C=max(2, triton.next_power_of_2(chunks)),
                                                    **pdl_flags(logits.device))
    return out
