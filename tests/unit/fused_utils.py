"""Shared set-up of the fused-kernel tests: the Triton interpreter on a machine without a
GPU (TRITON_INTERPRET=1 must be set before triton is first imported, so import this
first), the device, the dtypes, and running one call on both sides of the switch.

Half types: bf16 on CUDA only, since the interpreter casts fp32 -> bf16 by truncation
rather than round-to-nearest (checked: results differ by 1 bf16 ulp); fp16 everywhere.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from specserve import kernels  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV.type == "cuda" else [])


def both(fn):
    """(fused result, torch result) of fn()."""
    with kernels.fused_kernels(True), torch.no_grad():
        got = fn()
    with kernels.fused_kernels(False), torch.no_grad():
        ref = fn()
    return got, ref


def gpu_float32_tiles(monkeypatch, module) -> None:
    """`module`'s few-token launches (skinny.py, qkv_rope.py) take a GPU's float32 launch
    shapes on any device: skinny_config.f32_config for 132 SMs."""
    from specserve.kernels import skinny_config

    monkeypatch.setattr(module, "_config", lambda n, k, gated, *a: skinny_config.f32_config(n, k, gated, 132))
