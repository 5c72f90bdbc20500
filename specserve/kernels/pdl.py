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
