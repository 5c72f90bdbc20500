"""SiLU-and-mul for the gated MLP: gate_up [T, 2I] -> silu(gate) * up [T, I] in one launch.

Numerics follow the torch path `F.silu(gate) * up` op by op: silu computed in fp32 as
g / (1 + exp(-g)) and rounded to the input dtype (what F.silu returns), then multiplied
by up in fp32 and rounded again (what the elementwise mul returns). In fp32 both roundings
are no-ops. Grid: (T, column blocks of I).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl_flags
from specserve.kernels.pdl import wait_and_release

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, sx, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_and_release(USE_PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(x_ptr + t * sx + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * sx + inter + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)  # F.silu's rounding
    tl.store(out_ptr + t * inter + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, gate_up.shape
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, i, dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(i))
    _silu_and_mul_kernel[(t, triton.cdiv(i, block))](gate_up, out, i, gate_up.stride(0), BLOCK=block,
                                                     num_warps=4, **pdl_flags(gate_up.device))
    return out
