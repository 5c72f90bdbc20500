"""The programmatic-dependent-launch prologue shared by the small Triton kernels.

A kernel launched with `kernels.pdl_flags` (launch_pdl) may start while the kernel ahead
of it is still running. `wait_and_release` waits until every earlier kernel's writes are
visible (gdc_wait, `wait_for_inputs`) and lets the kernel after it launch
(gdc_launch_dependents, `release_dependents`). Kernels
with no work that is independent of their inputs call it first and gain the launch
latency only; the GEMVs (`matvec.py`, `skinny.py`) call it after fetching their first
weight tile, which no earlier kernel writes; skinny.py's looped ones also ask L2 for the
rest of their rows there (`prefetch_l2`, where `prefetch_step` says so), and so do the
deterministic mode's products of short rows (`invariant_mm.prefetch_rule`); its products of
long rows release the next kernel only after their K loop (`invariant_mm.release_late`).
"""
import torch
import triton
import triton.language as tl

from specserve.core import env

L2_PREFETCH = env.l2_prefetch_allowed()  # SPECSERVE_L2_PREFETCH=0 turns it off


@triton.jit
def wait_and_release(USE_PDL: tl.constexpr):
    wait_for_inputs(USE_PDL)
    release_dependents(USE_PDL)


@triton.jit
def wait_for_inputs(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_dependents(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(base, n, LINES: tl.constexpr, STEP: tl.constexpr):
    """Ask L2 for elements base[0:n), one `prefetch.global.L2` per STEP elements (a
    128-byte line), LINES of them per round across the program's threads. Nothing waits
    for them: a kernel issues them before its PDL wait for the tiles its loop reads after it."""
    offs = tl.arange(0, LINES) * STEP
    for o in range(0, n, LINES * STEP):
        at = o + offs
        ptrs = tl.where(at < n, base + at, base)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


def prefetch_step(weight: torch.Tensor, block_k: int, split: int, tma: bool = False) -> int:
    """The PREFETCH constexpr of a few-token launch over weight [N, K] in K tiles of
    block_k (K split over `split` programs): elements per 128-byte line when its programs
    ask L2 for the rest of their rows before the PDL wait (`prefetch_l2`), else 0.

    Only where a program's loop reads K tiles after the wait (one tile, a split K and TMA
    fetch theirs before it or pipeline them), from a contiguous weight, and not for an
    lm_head (16384 rows or more), whose programs outnumber what runs at once: there the
    prefetches slow the head down. qkv_rope.py's loop does not prefetch: it gains nothing."""
    if not (weight.is_cuda and L2_PREFETCH):  # the interpreter runs no inline asm
        return 0
    return prefetch_rule((weight.shape[0], weight.shape[1]), (weight.stride(0), weight.stride(1)),
                         weight.element_size(), block_k, split, tma)


def prefetch_rule(shape: tuple[int, int], strides: tuple[int, int], w_bytes: int, block_k: int, split: int,
                  tma: bool) -> int:
    """`prefetch_step` for a weight of `shape`, `strides` and element size, on any device."""
    looped = not tma and split == 1 and block_k < shape[1]
    contiguous = strides == (shape[1], 1)
    return 128 // w_bytes if looped and contiguous and shape[0] < 16384 else 0
