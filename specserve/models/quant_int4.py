"""4-bit weights: AWQ and GPTQ checkpoints converted into our one int4 layout, and its math.

Our layout is a `QuantWeight` (core/quant.py) with method "int4", for a weight [N, K]:

| field | dtype, shape | holds |
|---|---|---|
| data | uint8 [N, K / 2] | q(n, k) in byte k // 2 of row n: the low nibble for even k, the high for odd k |
| scale | float32 [N, groups] | one scale per row and per `group` input columns, groups = ceil(K / group) |
| zeros | uint8 [N, groups] | the integer zero point of each (row, group), 0..16 |

value(n, k) = (q(n, k) - zeros[n, k // group]) * scale[n, k // group], in float32: q - zero is
an exact small integer, so the value is one fp32 rounding of its product, the same in torch
(`dequantize_int4`, the reference) and in the kernel (kernels/int4.py). The last group may be
ragged (K not a multiple of `group`).

Why this layout: rows along K, as every other weight of ours is [N, K], so a program that owns
output rows streams each row's bytes contiguously (a 16-byte load is 32 consecutive weights)
and unpacks them in registers; AWQ packs along N in a shuffled order and GPTQ along K in int32
words, neither of which a row-owning GEMV reads well. Zeros are uint8 rather than float: they
are integers by construction in both formats (one byte per group, a third of the scale's
cost), and GPTQ v1's "stored zero + 1" reaches 16, which a nibble could not hold.

Invariants: K is even (every AWQ/GPTQ checkpoint's K is a multiple of 8), so K = 2 *
data.shape[1] (`int4_in_features`); a converted weight equals its checkpoint's dequantized
weight value for value (fp16 scales widen exactly). Config errors are one-line ValueErrors.

Checkpoint layouts read here (K input features, N output features, G the group):
- AWQ (`quant_method` "awq", `version` "gemm"): qweight int32 [K, N / 8], word n // 8 of row k
  holding column n at nibble AWQ_ORDER.index(n % 8); qzeros int32 [K / G, N / 8], the same
  packing; scales fp16 [K / G, N]. Zero points are stored as they are.
- GPTQ (`quant_method` "gptq"): qweight int32 [K / 8, N], word k // 8 of column n holding row k
  at nibble k % 8; qzeros int32 [K / G, N / 8], column n at nibble n % 8; scales fp16 [K / G, N];
  g_idx int32 [K] (the group of each input column). `checkpoint_format` "gptq" (v1) stores
  zero - 1, "gptq_v2" the zero itself. Act-order (a g_idx that is not k // G) is refused.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from specserve.core import quant
from specserve.core.quant import QuantWeight, unpack_nibbles

INT4 = quant.INT4
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
_AWQ_UNDO = tuple(AWQ_ORDER.index(j) for j in range(8))  # column j sits at nibble _AWQ_UNDO[j]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(frozen=True)
class Int4Config:
    """A checkpoint's 4-bit quantization, from config.json's `quantization_config`."""

    method: str  # "awq" or "gptq"
    group: int  # input columns per scale; -1: the whole row
    sym: bool = False  # GPTQ: symmetric (zero point 8)
    desc_act: bool = False  # GPTQ act-order: accepted only where every layer's g_idx is trivial
    v2: bool = False  # GPTQ checkpoint_format "gptq_v2": zero points stored without the -1


def int4_config(hf_config: Mapping[str, Any]) -> Int4Config | None:
    """The 4-bit quantization that a config.json (as a dict) declares, or None where it
    declares none or another method (fp8, ...). Raises ValueError for what we cannot load."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        return None
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method} with bits={bits} is not supported: only 4-bit weights are")
    group = int(qc.get("group_size", qc.get("q_group_size", -1)))
    if group == 0 or group < -1:
        raise ValueError(f"{method} group_size={group} is not valid: a positive size or -1")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported: only 'gemm' checkpoints are")
        if not qc.get("zero_point", True):
            raise ValueError("AWQ zero_point=false is not supported: only zero-point (asymmetric) checkpoints are")
        return Int4Config("awq", group)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported: 'gptq' or 'gptq_v2'")
    return Int4Config("gptq", group, sym=bool(qc.get("sym", True)), desc_act=bool(qc.get("desc_act", False)),
                      v2=fmt == "gptq_v2")


# -- our layout ---------------------------------------------------------------------------

def int4_in_features(qw: QuantWeight) -> int:
    """K of an int4 weight (`QuantWeight.shape` counts its bytes)."""
    return 2 * int(qw.data.shape[1])


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] of 4-bit values q [N, K] (K even): even k low, odd k high."""
    assert q.shape[1] % 2 == 0, q.shape
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def _per_column(t: torch.Tensor, group: int, k: int) -> torch.Tensor:
    return t.repeat_interleave(group, dim=1)[:, :k]


def dequantize_int4(qw: QuantWeight) -> torch.Tensor:
    """The reference: float32 [N, K] of an int4 weight, (q - zero) * scale per group."""
    assert qw.method == INT4 and qw.zeros is not None, (qw.method, qw.zeros is None)
    return quant.dequantize_int4(qw.data, qw.scale, qw.zeros, qw.group)


def linear_int4(x: torch.Tensor, qw: QuantWeight, *, residual: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The torch path of kernels/int4.py `int4_matmul`, and its rounding contract: the weight
    dequantized in float32 and rounded once to x's dtype, F.linear, then the residual add."""
    y = F.linear(x, dequantize_int4(qw).to(x.dtype))
    if residual is not None:
        y = y + residual
    return y.to(out_dtype or x.dtype)


def quantize_int4(weight: torch.Tensor, group: int = 128, *, sym: bool = False,
                  scale_dtype: torch.dtype = torch.float32) -> QuantWeight:
    """An int4 weight of a float weight [N, K] (K even), per row and `group` columns.
    Asymmetric (default): min/max over the group with 0 inside the range, scale = (max - min)
    / 15, zero = round(-min / scale). sym: GPTQ's symmetric form, scale = 2 absmax / 15, zero
    8. Each value then lies within scale / 2 of the weight. scale_dtype: round the scales to
    it first (float16: what AWQ/GPTQ checkpoints store, so `pack_awq`/`pack_gptq` round-trip
    exactly). A group of zeros gets scale 1."""
    w = weight.detach().float()
    n, k = w.shape
    if k % 2:
        raise ValueError(f"int4 weights need an even number of input features, got {k}")
    if group == 0 or group < -1:
        raise ValueError(f"int4 group size must be positive or -1 (the whole row), got {group}")
    group = k if group == -1 else group
    groups = -(-k // group)
    g = F.pad(w, (0, groups * group - k)).view(n, groups, group)  # pad zeros: inside any range
    lo, hi = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    exact = torch.where(hi > lo, (hi.double() - lo.double()) / 15, torch.ones_like(hi, dtype=torch.float64))
    scale = exact.to(scale_dtype)  # rounded up where it rounded down: 15 steps still span the range
    scale = torch.where(scale.double() < exact, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    scale = scale.float()
    zeros = torch.full_like(scale, 8.0) if sym else torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(w / _per_column(scale, group, k)) + _per_column(zeros, group, k)
    return QuantWeight(pack_nibbles(q.clamp(0, 15)), scale.contiguous(), group, INT4,
                       zeros.to(torch.uint8).contiguous())


# -- checkpoint words ---------------------------------------------------------------------

def _unpack_words(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> the 8 nibbles of each word [..., W, 8] (nibble i: bits 4i..4i+3)."""
    return (words.to(torch.int32).unsqueeze(-1) >> _SHIFTS.to(words.device)) & 0xF


def _pack_words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., W, 8] values 0..15 -> int32 [..., W], nibble i at bits 4i (two's complement)."""
    v = ((nibbles.to(torch.int64) & 0xF) << _SHIFTS.to(nibbles.device, torch.int64)).sum(dim=-1)
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def _groups(k: int, group: int, scales: torch.Tensor, what: str) -> int:
    group = k if group == -1 else group
    if scales.shape[0] != -(-k // group):
        raise ValueError(f"{what}: scales have {scales.shape[0]} groups, expected ceil({k} / {group})")
    return group


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> QuantWeight:
    """Our int4 weight of an AWQ (gemm) layer: qweight int32 [K, N / 8], qzeros int32
    [K / G, N / 8], scales [K / G, N] (module docstring); group -1: the whole row."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if k % 2:
        raise ValueError(f"int4 weights need an even number of input features, got {k}")
    group = _groups(k, group, scales, "AWQ")
    undo = list(_AWQ_UNDO)
    q = _unpack_words(qweight)[..., undo].reshape(k, n)
    zeros = _unpack_words(qzeros)[..., undo].reshape(-1, n)
    return QuantWeight(pack_nibbles(q.t()), scales.t().float().contiguous(), group, INT4,
                       zeros.t().to(torch.uint8).contiguous())


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor, group: int, *,
              sym: bool = True, v2: bool = False, g_idx: torch.Tensor | None = None,
              desc_act: bool = False) -> QuantWeight:
    """Our int4 weight of a GPTQ layer: qweight int32 [K / 8, N], qzeros int32 [K / G, N / 8]
    (None for a symmetric layer that has none: zero 8), scales [K / G, N], g_idx [K] (module
    docstring); group -1: the whole row. v1 zero points are stored minus one; v2 as they are.
    Raises ValueError for act-order: a g_idx other than k // group, or desc_act without g_idx."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    group = _groups(k, group, scales, "GPTQ")
    if g_idx is not None:
        trivial = torch.arange(g_idx.numel(), device=g_idx.device) // group
        if g_idx.numel() != k or not torch.equal(g_idx.long(), trivial):
            raise ValueError("GPTQ act-order (desc_act, a permuted g_idx) is not supported: requantize without it")
    elif desc_act:
        raise ValueError("GPTQ desc_act=true without g_idx is not supported: requantize without act-order")
    q = _unpack_words(qweight.t()).reshape(n, k)  # word r of column n: rows 8r..8r+7
    if qzeros is None:
        if not sym:
            raise ValueError("GPTQ sym=false needs qzeros: the checkpoint has none")
        zeros = torch.full(scales.shape[::-1], 8, dtype=torch.uint8, device=scales.device)
    else:
        z = _unpack_words(qzeros).reshape(qzeros.shape[0], -1)[:, :n]
        zeros = (z if v2 else z + 1).t().to(torch.uint8)
    return QuantWeight(pack_nibbles(q), scales.t().float().contiguous(), group, INT4, zeros.contiguous())


def convert_int4(layer: Mapping[str, torch.Tensor], cfg: Int4Config) -> QuantWeight:
    """Our int4 weight of one checkpoint layer's tensors, keyed by their last name part:
    `qweight`, `qzeros`, `scales` and (GPTQ, optional) `g_idx`."""
    if cfg.method == "awq":
        return from_awq(layer["qweight"], layer["qzeros"], layer["scales"], cfg.group)
    return from_gptq(layer["qweight"], layer.get("qzeros"), layer["scales"], cfg.group, sym=cfg.sym, v2=cfg.v2,
                     g_idx=layer.get("g_idx"), desc_act=cfg.desc_act)


# -- the inverses: synthetic checkpoints for tests ----------------------------------------

def _checkpoint_parts(qw: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] int64, zeros [N, groups] int64, fp16 scales [groups, N]) of an int4 weight."""
    assert qw.method == INT4 and qw.zeros is not None
    n = qw.data.shape[0]
    if n % 8:
        raise ValueError(f"AWQ/GPTQ pack 8 output features a word: N={n} is not a multiple of 8")
    return unpack_nibbles(qw.data).long(), qw.zeros.long(), qw.scale.t().half().contiguous()


def pack_awq(qw: QuantWeight) -> dict[str, torch.Tensor]:
    """An AWQ (gemm) layer's tensors {qweight, qzeros, scales} holding `qw` (N a multiple of
    8; scales stored fp16: quantize with scale_dtype=torch.float16 for an exact round trip)."""
    q, zeros, scales = _checkpoint_parts(qw)
    order = list(AWQ_ORDER)
    qweight = _pack_words(q.t().reshape(q.shape[1], -1, 8)[..., order])
    qzeros = _pack_words(zeros.t().reshape(zeros.shape[1], -1, 8)[..., order])
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales}


def pack_gptq(qw: QuantWeight, *, v2: bool = False) -> dict[str, torch.Tensor]:
    """A GPTQ layer's tensors {qweight, qzeros, scales, g_idx} holding `qw` (N and K multiples
    of 8; scales stored fp16). v1 (default) stores zero - 1 in a nibble, so a zero point of 0
    cannot be written: ValueError (use v2)."""
    q, zeros, scales = _checkpoint_parts(qw)
    n, k = q.shape
    if k % 8:
        raise ValueError(f"GPTQ packs 8 input features a word: K={k} is not a multiple of 8")
    if not v2:
        if bool((zeros == 0).any()):
            raise ValueError("GPTQ v1 cannot store a zero point of 0 (it stores zero - 1): pack with v2=True")
        zeros = zeros - 1
    qweight = _pack_words(q.reshape(n, k // 8, 8)).t().contiguous()
    qzeros = _pack_words(zeros.t().reshape(zeros.shape[1], -1, 8))
    g_idx = (torch.arange(k, device=q.device) // qw.group).to(torch.int32)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
