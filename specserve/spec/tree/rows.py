"""A drafting pass's row bookkeeping: the draft extend's root rows, and the fan-out of
every request into its k first-depth branches; one launch each on CUDA (`kernels/draft_rows.py`).

At batch 1 a speculative step is bound by launches, and with torch ops each of these is a
handful of gathers, copies and adds of a few rows, each launch near its latency floor:

  root_rows (the draft extend's last row per request; two gathers and a copy in torch):
    x_last[b] = h_logits[last[b]]         the lm_head's input for the root's children
    hidden[b] = h_next[last[b]]           the root state's hidden ...
    buf[dst[b]] = hidden[b]               ... also kept per table row (RootStates.hidden)

  fan_out (a tree pass's start; three repeat_interleaves and an add in torch):
    rows_k[b*k + j] = rows[b]             tail_k[b*k + j] = tail[b]
    positions[d, b*k + j] = tail[b] + d   for d < depths (depth d + 1's RoPE positions)
    states_k[b*k + j] = states[b]         the first depth's input hidden, when there is one

`root_rows_torch` and `fan_out_torch` are the references (CPU, and tests compare).
"""
from __future__ import annotations

import torch

from specserve import kernels


def root_rows(h_logits: torch.Tensor, h_next: torch.Tensor | None, last: torch.Tensor, dst: torch.Tensor,
              buf: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x_last [B, H], hidden [B, H] or None) from h_logits / h_next [T, H] at rows `last`
    [B]; hidden also goes to buf[dst] ([R, H]) when both exist (module docstring)."""
    if not kernels.use_fused(h_logits):
        return root_rows_torch(h_logits, h_next, last, dst, buf)
    from specserve.kernels.draft_rows import root_rows_fused  # imports triton: CUDA only

    return root_rows_fused(h_logits, h_next, last, dst, buf)


def root_rows_torch(h_logits: torch.Tensor, h_next: torch.Tensor | None, last: torch.Tensor, dst: torch.Tensor,
                    buf: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = h_next[last] if h_next is not None else None
    if hidden is not None:
        assert buf is not None, "a hidden state needs its per-row buffer"
        buf.index_copy_(0, dst, hidden.to(buf.dtype))
    return h_logits[last], hidden


def fan_out(rows: torch.Tensor, tail: torch.Tensor, states: torch.Tensor | None, k: int,
            depths: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(rows_k [B*k], tail_k [B*k], positions [depths, B*k], states_k [B*k, H] or None)
    from rows, tail [B] int64 and states [B, H] (module docstring)."""
    if not kernels.use_fused(tail):
        return fan_out_torch(rows, tail, states, k, depths)
    from specserve.kernels.draft_rows import fan_out_fused  # imports triton: CUDA only

    return fan_out_fused(rows, tail, states, k, depths)


def fan_out_torch(rows: torch.Tensor, tail: torch.Tensor, states: torch.Tensor | None, k: int,
                  depths: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    rows_k, tail_k = rows.repeat_interleave(k), tail.repeat_interleave(k)
    positions = tail_k + torch.arange(depths, device=tail.device)[:, None]
    return rows_k, tail_k, positions, states.repeat_interleave(k, dim=0) if states is not None else None
