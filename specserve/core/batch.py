"""ScheduleBatch: the scheduler's CPU-side description of one forward.

The scheduler decides which requests run and how many new tokens each contributes and
has already allocated their slots; `ModelRunner` turns this into a device ForwardBatch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.core.forward_batch import ForwardMode
from specserve.core.request import Req


@dataclass
class ScheduleBatch:
    mode: ForwardMode
    reqs: list[Req]
    input_ids: list[int] | torch.Tensor  # packed new tokens, request by request (drafts: on the device)
    out_slots: torch.Tensor  # [T] slots of the new tokens
    prefix_lens: list[int]  # KV length of each request before this forward
    extend_lens: list[int]
    sample_mask: list[bool]  # which requests get a next token from this forward
    # Speculative verify: explicit positions (seq_len + depth), tree masks over each
    # request's new tokens, and logits for every new token instead of the last ones.
    positions: list[int] | torch.Tensor | None = None
    custom_masks: list[torch.Tensor] | torch.Tensor | None = None  # [n_b, n_b] each (or [B, N, N]), host or device
    all_logits: bool = False
    rows: list[int] | None = None  # table rows to read KV from, when not the requests' own

    @staticmethod
    def decode(reqs: list[Req], slots: torch.Tensor, prefix_lens: list[int],
               input_ids: list[int] | torch.Tensor | None = None) -> ScheduleBatch:
        """One plain decode step: each request feeds its last token at position prefix_lens[b]
        (`input_ids` when given: an overlapped step's tokens, still on the device)."""
        n = len(reqs)
        ids = [r.last_id for r in reqs] if input_ids is None else input_ids
        return ScheduleBatch(ForwardMode.DECODE, reqs, ids, slots, prefix_lens, [1] * n, [True] * n)

    @property
    def sampled_reqs(self) -> list[Req]:
        return [r for r, s in zip(self.reqs, self.sample_mask) if s]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)
