"""Seeded Gumbel noise in one Triton launch: the sampler's counter-based noise for [R, V].

`runner.sampler.uniform_noise` hashes (seed, counter, column) with about twenty-five int64
torch ops over the whole [R, V] block, each a launch; at batch 1, where a step is bound by
launches, they and the two logs after make a sampled step much slower than a greedy one. Here one
program owns BLOCK columns of one row and runs the same integer hash (uint32 values held
in int64, so every product stays below 2**63, as in torch: bit-exact) and the same float32
steps, u = ((h >> 9) + 0.5) / 2**23 and g = -log(-log(u)). Triton's log may round the last
bit differently from torch's, so the noise matches the torch path to ~1e-6, not bitwise;
every sampled path on a GPU (plain decoding and speculative verification) draws it from
`gumbel_at`, here or inside argmax.py's draw, so they stay token-identical to each other
under a seed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl_flags
from specserve.kernels.pdl import wait_and_release

BLOCK = 4096


@triton.jit
def _mix32(x):
    """sampler._mix32: xorshift-multiply on uint32 values held in int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def gumbel_at(seed, counter, cols):
    """The noise at columns `cols` of the row keyed (seed, counter), both int64 scalars:
    the one formula every kernel that draws it shares (argmax.py adds it to logits
    without storing it), so their draws agree bit for bit."""
    h = _mix32((seed & 0xFFFFFFFF) ^ _mix32(seed >> 32))
    h = _mix32(h ^ _mix32(counter & 0xFFFFFFFF))
    h = _mix32(h ^ cols.to(tl.int64))
    u = ((h >> 9).to(tl.float32) + 0.5) / 8388608.0
    return -tl.log(-tl.log(u))


@triton.jit
def _gumbel_kernel(seed_ptr, counter_ptr, out_ptr, V, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_and_release(USE_PDL)  # the counters may be the kernel before's
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seed_ptr + row).to(tl.int64)
    counter = tl.load(counter_ptr + row).to(tl.int64)
    tl.store(out_ptr + row.to(tl.int64) * V + cols, gumbel_at(seed, counter, cols), mask=cols < V)


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, width: int) -> torch.Tensor:
    """[R, width] float32 Gumbel(0, 1) noise for seeds [R] and counters [R] (int64, >= 0)."""
    rows = seeds.numel()
    out = torch.empty(rows, width, dtype=torch.float32, device=seeds.device)
    if rows and width:
        grid = (rows, triton.cdiv(width, BLOCK))
        _gumbel_kernel[grid](seeds.contiguous(), counters.contiguous(), out, width, BLOCK=BLOCK,
                                   **pdl_flags(seeds.device))
    return out
