"""The programmatic-dependent-launch prologue shared by the small Triton kernels.

A kernel launched with `kernels.pdl_flags` (launch_pdl) may start while the kernel ahead
of it is still running. `wait_and_release` waits until every earlier kernel's writes are
visible (gdc_wait) and lets the kernel after it launch (gdc_launch_dependents). Kernels
with no work that is independent of their inputs call it first and gain the launch
latency only; the GEMVs (`matvec.py`, `skinny.py`) call it after fetching their first
weight tile, which no earlier kernel writes.
"""
import triton
import triton.language as tl


@triton.jit
def wait_and_release(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
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
