"""Rotary position embeddings (Llama "rotate half" convention) and their scalings.

Owns the cos/sin tables and how positions index them (`apply_rope` hands CUDA tensors
to the fused kernel in `specserve.kernels.rope`). The frequencies are computed in
float32 exactly as Hugging Face does, so our logits match theirs bit for bit in fp32.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from specserve import kernels
from specserve.core.rope import RopeAt


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling (long wavelengths slowed by `factor`)."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    assert scaling is not None  # any other kind was read from it
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, llama3, linear)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling = theta, scaling
        self.table: torch.Tensor | None = None  # [max_positions, 2D]: cos, then sin
        self.cos: torch.Tensor | None = None  # [max_positions, D], a view of the table
        self.sin: torch.Tensor | None = None  # [max_positions, D], first half negated

    def build(self, device: torch.device, dtype: torch.dtype) -> None:
        """Tables [max_positions, head_dim]; built after weights land on their device."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        pos = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        # rotate_half(x) * sin == roll(x, D/2) * [-sin | sin]: one roll instead of
        # slice/neg/cat, bit-identical (negation is exact).
        cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1).to(dtype)
        sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(dtype)
        self.table = torch.cat([cos, sin], dim=-1)  # [max_positions, 2D]: one gather per lookup
        self.cos, self.sin = self.table[:, :self.head_dim], self.table[:, self.head_dim:]

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [T, 1, D] for positions [T]: views of one gathered [T, 1, 2D]
        (one gather launch for both tables)."""
        return self.at(positions).tables()

    def at(self, positions: torch.Tensor) -> RopeAt:
        """The tables at one forward's positions [T], gathered when a layer first asks."""
        assert self.table is not None, "build() makes the tables once the weights are placed"
        return RopeAt(self.table, positions, self.head_dim)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (queries and keys together) rotated by (cos, signed sin) [T, 1, D].
    One Triton launch on CUDA (`specserve.kernels`); four elementwise ops otherwise."""
    if kernels.use_fused(x):
        return kernels.apply_rope(x, cos, sin)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
