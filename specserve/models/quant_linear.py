"""A quantized linear layer's product where the model calls the layer itself (prefill,
large batches, layers off the few-token path): x [T, K] times a `QuantWeight` [N, K].

int4 (AWQ, GPTQ) and a GGUF's blocks (q4, q8): up to PACKED_MAX_TOKENS rows on CUDA
through the fused dequantize-multiply kernels (kernels/int4.py, kernels/blocks.py), more
through the dequantized weight; on the CPU a GGUF's blocks take kernels/cpu_quant.py.
fp8 with per-row scales on a GPU that has fp8 tensor cores (compute capability 8.9+,
half activations, both sides a multiple of 16): each token is quantized to e4m3 with its own scale (absmax / 448) and
`torch._scaled_mm` multiplies the two fp8 operands, scaling rows and columns in its
epilogue, as vLLM's and SGLang's fp8 linear layers do. Everywhere else (block scales,
float32 activations, older GPUs, the CPU) the weight is dequantized for the call
(core/quant.py) and multiplied by `F.linear`: the reference the kernels follow.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve import kernels
from specserve.core import quant
from specserve.kernels import cpu_quant

_HALF = (torch.float16, torch.bfloat16)
# Rows up to which a 4-bit or GGUF-block weight is multiplied by its few-token kernel, 32
# rows a weight pass: four passes of such a weight read fewer bytes than one dequantized copy
PACKED_MAX_TOKENS = 128
_FP8_MM: dict[int | None, bool] = {}  # device index -> has fp8 tensor cores


def quant_linear(x: torch.Tensor, qw: quant.QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ the dequantized weight's transpose (+ bias) -> [..., N] in x's dtype."""
    n, k = qw.shape
    if qw.method in (quant.Q4, quant.Q8) and not x.is_cuda:
        return _gguf_cpu_linear(x, qw, bias)
    if qw.method in (quant.INT4, quant.Q4, quant.Q8):
        rows = x.reshape(-1, k)
        if kernels.use_fused(x) and rows.shape[0] <= PACKED_MAX_TOKENS:
            out = kernels.packed_matmul(rows, qw)
            return (out if bias is None else out + bias).reshape(*x.shape[:-1], n)
        return F.linear(x, qw.dequantize(x.dtype), bias)
    if not _scaled_mm_serves(x, qw):
        return F.linear(x, qw.dequantize(x.dtype), bias)
    rows = x.reshape(-1, k)
    xq, xs = quantize_tokens(rows)
    out = torch._scaled_mm(xq, qw.data.t(), scale_a=xs, scale_b=qw.scale.reshape(1, n), out_dtype=x.dtype)
    if bias is not None:  # added apart: _scaled_mm's own bias falls back to addmm on fp8 operands
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


def _gguf_cpu_linear(x: torch.Tensor, qw: quant.QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """A GGUF's blocks on the CPU: its kernel at any row count, float32 in and out (it keeps
    pace with BLAS on the dequantized weight from a few hundred rows, and a row's sums do
    not depend on the others); through the dequantized weight where it cannot run (no
    compiler, or a shape its tiles do not cover)."""
    n, k = qw.shape
    rows = x.reshape(-1, k)
    if cpu_quant.available() and cpu_quant.servable(qw):
        out = cpu_quant.matmul(rows.float(), qw).to(x.dtype)
        if bias is not None:
            out = out + bias
    else:
        out = F.linear(rows, qw.dequantize(x.dtype), bias)
    return out.reshape(*x.shape[:-1], n)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [T, K], float32 scales [T, 1]) of activations x [T, K], one scale per token."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = torch.clamp(amax / quant.FP8_MAX, min=1e-12)
    return (x.float() / scale).clamp(-quant.FP8_MAX, quant.FP8_MAX).to(quant.FP8), scale


def _scaled_mm_serves(x: torch.Tensor, qw: quant.QuantWeight) -> bool:
    n, k = qw.shape
    return (x.is_cuda and x.dtype in _HALF and qw.group >= k and n % 16 == 0 and k % 16 == 0
            and has_fp8_tensor_cores(x.device) and x.numel() > 0)


def has_fp8_tensor_cores(device: torch.device) -> bool:
    """Whether CUDA `device` multiplies fp8 (compute capability 8.9, Ada, or 9.0+, Hopper)."""
    if device.index not in _FP8_MM:
        _FP8_MM[device.index] = torch.cuda.get_device_capability(device) >= (8, 9)
    return _FP8_MM[device.index]
