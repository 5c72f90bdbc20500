"""RopeAt: the rotary tables at one forward's positions, shared by the model and the kernels.

The model builds it (`models/rope.py` RotaryEmbedding.at); the fused kernels read its
table rows themselves (`kernels/qkv_rope.py`). It owns no math beyond the gather.
"""
from __future__ import annotations

import torch


class RopeAt:
    """The rotary tables at one forward's positions [T]: `tables()` gathers (cos, signed
    sin) [T, 1, D] on first use and keeps them for the forward's other layers. The
    few-token kernel (`kernels/qkv_rope.py`) reads `table` [max_positions, 2D] rows at
    `positions` itself, so a forward whose layers all take it launches no gather (a
    verify and each drafting depth spent one torch launch on it)."""

    def __init__(self, table: torch.Tensor, positions: torch.Tensor, head_dim: int) -> None:
        self.table, self.positions, self.head_dim = table, positions, head_dim
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._gathered is None:
            both = self.table[self.positions].unsqueeze(1)
            self._gathered = both[..., :self.head_dim], both[..., self.head_dim:]
        return self._gathered
