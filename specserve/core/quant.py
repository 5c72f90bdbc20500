"""Quantized weights: the one representation every layer and kernel shares, and its math.

A quantized linear weight is a `QuantWeight`: `data` holds the stored values, `scale`
float32 [N, groups] one scale per output row and per `group` input columns (per channel:
groups 1 and group K; DeepSeek/Qwen3 block checkpoints: group 128, each row of a 128-row
block repeating its block's scale), the last group ragged where K is not a multiple.

| method | data | value of element (n, k), g = k // group |
|---|---|---|
| fp8 | float8_e4m3fn [N, K] | data[n, k] * scale[n, g] |
| int4 | uint8 [N, K / 2]: q(n, k) in byte k // 2, even k low | (q(n, k) - zeros[n, g]) * scale[n, g] |
| q4 | uint8 [N, K / 2]: blocks of 32 columns in 16 bytes, byte j: column j low, j + 16 high | q * scale + zeros[n, g] |
| q8 | int8 [N, K] | q(n, k) * scale[n, g] (+ zeros[n, g] if any) |

int4 weights come from AWQ and GPTQ checkpoints (models/quant_int4.py converts their
layouts); their zero points are uint8 [N, groups]. Once loaded they are held as q4 blocks of
the same values where the blocks' kernels serve them (`int4_to_q4`, offsets -zero * scale).
q4 and q8 are GGUF's blocks repacked at conversion (models/gguf_blocks.py): Q4_0, Q4_1 and
Q4_K become q4 (group 32), Q8_0, Q6_K (group 16) and Q5_0/Q5_1/Q5_K become q8; their
`zeros` are float32 offsets [N, groups] (GGUF's mins), None where the format has none. The
CPU multiplies them as they are (kernels/cpu_quant.py).

`dequantize` is the reference every kernel is tested against: the value in float32, then
rounded once to the activations' dtype. `quantize_fp8` makes per-row (or per-group) scales
from a float weight: absmax / 448, the largest finite e4m3.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
METHODS = ("fp8", "awq", "gptq")  # --quantization values; awq and gptq load as int4
INT4 = "int4"
Q4, Q8 = "q4", "q8"  # GGUF's blocks (models/gguf_blocks.py)


class QuantWeight(NamedTuple):
    """A quantized [N, K] weight (see the module docstring); what `Linear.out_in_weight`
    hands the kernels when its layer is quantized."""

    data: torch.Tensor
    scale: torch.Tensor  # float32 [N, groups]
    group: int  # input columns one scale covers
    method: str = "fp8"  # how `data` holds the values (the module docstring's table)
    zeros: torch.Tensor | None = None  # int4's zero points, q4/q8's offsets [N, groups]; None: none

    @property
    def shape(self) -> tuple[int, int]:
        """[N, K] of the weight it holds (two int4 values a byte)."""
        k = int(self.data.shape[1]) * (2 if self.method in (INT4, Q4) else 1)
        return int(self.data.shape[0]), k

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] in `dtype`: each element in float32, rounded once."""
        if self.method == INT4:
            assert self.zeros is not None
            return dequantize_int4(self.data, self.scale, self.zeros, self.group).to(dtype)
        if self.method in (Q4, Q8):
            return dequantize_gguf(self).to(dtype)
        return dequantize_fp8(self.data, self.scale, self.group).to(dtype)


def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """float32 [N, K] of fp8 data [N, K] and scales [N, ceil(K / group)]."""
    k = data.shape[1]
    per_col = scale if scale.shape[1] == 1 else scale.repeat_interleave(group, dim=1)[:, :k]
    return data.float() * per_col.float()


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """The 4-bit values [N, 2 * bytes] (uint8) of packed data [N, bytes]."""
    return torch.stack((data & 0xF, data >> 4), dim=2).reshape(data.shape[0], -1)


def dequantize_int4(data: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """float32 [N, K] of int4 data [N, K / 2]: (q - zero) * scale per group."""
    q = unpack_nibbles(data).float()
    k = q.shape[1]
    return ((q - zeros.float().repeat_interleave(group, dim=1)[:, :k])
            * scale.float().repeat_interleave(group, dim=1)[:, :k])


def dequantize_gguf(qw: QuantWeight) -> torch.Tensor:
    """float32 [N, K] of a q4 or q8 weight: q * scale (+ offset) per group."""
    n = qw.data.shape[0]
    if qw.method == Q4:  # a group's 16 bytes: its first 16 columns low, its last 16 high
        blocks = qw.data.view(n, -1, 16)
        q = torch.cat((blocks & 0xF, blocks >> 4), dim=2).reshape(n, -1).float()
    else:
        q = qw.data.float()
    k = q.shape[1]
    if k % qw.group:  # a ragged last group (an int4 weight held as q4: int4_to_q4)
        w = q * qw.scale.float().repeat_interleave(qw.group, dim=1)[:, :k]
        return w if qw.zeros is None else w + qw.zeros.float().repeat_interleave(qw.group, dim=1)[:, :k]
    w = q.view(n, -1, qw.group) * qw.scale[:, :, None]
    if qw.zeros is not None:
        w = w + qw.zeros[:, :, None]
    return w.reshape(n, -1)


def quantize_fp8(weight: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 data [N, K], float32 scales [N, groups]) of a float weight [N, K]: each row's
    (or each `group` columns') absmax maps to 448. An all-zero row gets scale 1."""
    w = weight.detach().float()
    n, k = w.shape
    group = group or k
    groups = -(-k // group)
    padded = torch.nn.functional.pad(w, (0, groups * group - k)).view(n, groups, group)
    amax = padded.abs().amax(dim=2)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    per_col = scale.repeat_interleave(group, dim=1)[:, :k]
    data = (w / per_col).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return data, scale


def quantize_blocks(weight: torch.Tensor, method: str) -> QuantWeight:
    """A float weight [N, K] (K a multiple of 32) in GGUF's simplest blocks of 32 columns,
    scales and offsets in float16 as GGUF stores them: q4 as Q4_1 (scale (max - min) / 15,
    offset min) or q8 as Q8_0 (scale absmax / 127, no offset). For random-weight benchmarks;
    a GGUF file's own blocks come from models/gguf_blocks.py."""
    w = weight.detach().float()
    n, k = w.shape
    g = w.view(n, k // 32, 32)
    if method == Q8:
        scale = (g.abs().amax(dim=2) / 127).half().float()
        q = torch.round(g / torch.where(scale > 0, scale, 1.0)[:, :, None]).clamp(-127, 127)
        return QuantWeight(q.to(torch.int8).view(n, k), scale.half(), 32, Q8)
    lo = g.amin(dim=2).half().float()
    scale = ((g.amax(dim=2) - lo) / 15).half().float()
    q = torch.round((g - lo[:, :, None]) / torch.where(scale > 0, scale, 1.0)[:, :, None]).clamp(0, 15).to(torch.uint8)
    data = q[:, :, :16] | (q[:, :, 16:] << 4)  # byte j of a group: column j low, j + 16 high
    return QuantWeight(data.reshape(n, k // 2), scale.half(), 32, Q4, lo.half())


def int4_to_q4(qw: QuantWeight, shared: int | None = None) -> QuantWeight:
    """An int4 weight whose groups and rows are whole blocks of 32 columns as q4 of the same
    values: the nibbles regrouped as q4's blocks of 32 hold them, offset -zero * scale
    (float32); the groups kept where they span `shared` (default Q4_SHARED_BLOCKS) blocks or
    fewer, a power of two (AWQ/GPTQ's 32, 64, 128; the last one may be ragged), else one
    scale and offset a block. A value q * scale + offset differs from int4's (q - zero) *
    scale by at most fp32 rounding. Where the kernels serve int4 (models/layers.py
    `gpu_layout`, `cpu_layout`: one block a scale, as the CPU's kernels take them), this is
    the form they stream fastest."""
    n, k = qw.shape
    assert qw.method == INT4 and qw.zeros is not None and qw.group % 32 == 0 and k % 32 == 0, (qw.method, k)
    q = unpack_nibbles(qw.data).view(n, k // 32, 32)
    data = (q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(n, k // 2)  # byte j of a block: column j low, j + 16 high
    blocks = qw.group // 32
    scale, zeros, group = qw.scale.float(), qw.zeros.float(), qw.group
    if blocks > (Q4_SHARED_BLOCKS if shared is None else shared) or blocks & (blocks - 1):
        scale = scale.repeat_interleave(blocks, dim=1)[:, :k // 32].contiguous()
        zeros, group = zeros.repeat_interleave(blocks, dim=1)[:, :k // 32], 32
    return QuantWeight(data.contiguous(), narrow_exact(scale), group, Q4, narrow_exact(-zeros * scale))


Q4_SHARED_BLOCKS = 8  # the most q4 blocks one scale may cover (kernels/blocks.py's one-token tiles hold 8 or more)


def narrow_exact(t: torch.Tensor) -> torch.Tensor:
    """Float scales or offsets in float16 where every one of them is exact in it (fewer
    bytes a weight, no value changed), else as they are."""
    half = t.half()
    return half if torch.equal(half.float(), t.float()) else t


def expand_block_scale(scale: torch.Tensor, rows: int, block_rows: int) -> torch.Tensor:
    """A block checkpoint's scales [ceil(N / block_rows), groups] as one row per weight row
    [rows, groups]; a per-tensor scale (0-d or one element) as [rows, 1]; a per-channel one
    ([N] or [N, 1]) as [N, 1]."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, 1).contiguous()
    if scale.dim() == 1 or (scale.shape[0] == rows and scale.shape[1] == 1):
        return scale.reshape(-1, 1)
    return scale.repeat_interleave(block_rows, dim=0)[:rows].contiguous()
