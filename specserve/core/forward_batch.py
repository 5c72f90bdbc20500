"""ForwardBatch: everything one model forward needs, as device tensors.

Built by `runner/model_runner.py` from the scheduler's CPU-side batch. The model reads
`input_ids` and `positions`; the attention backend reads the rest (through its own
metadata, built once per forward in `init_forward_metadata`). T is the number of new
tokens in the batch, B the number of requests. The pool and the backend live in higher
layers (cache/, attention/); the batch knows them by the small protocols below.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import torch


class KVStore(Protocol):
    """A KV pool (`cache/kv_pool.py` KVPool): per-layer K and V indexed by token slot, and
    the scales an fp8 pool stores them with (stored = x / scale)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    k_scale: float
    v_scale: float

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...


class Attention(Protocol):
    """An attention backend (`attention/base.py` AttentionBackend), as a forward calls it."""

    pooled_kv: bool

    def init_forward_metadata(self, fb: ForwardBatch) -> None: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int,
                fb: ForwardBatch, scale: float) -> torch.Tensor: ...


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill / chunked prefill, possibly over a cached prefix
    DECODE = "decode"  # one new token per request
    VERIFY = "verify"  # root + drafts per request, with a tree mask (speculative)
    DRAFT_EXTEND = "draft_extend"  # draft model catching up on accepted tokens


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64: where the new tokens' K/V are written
    req_rows: torch.Tensor  # [B] int64: rows of the req-to-token table
    prefix_lens: list[int]  # [B] tokens already in the KV cache before this forward
    extend_lens: list[int]  # [B] new tokens per request (sum == T)
    req_to_token: torch.Tensor  # [max_reqs, max_context]: slots of positions < prefix+extend
    kv_pool: KVStore
    attn_backend: Attention
    # Per-request boolean masks over the new tokens ([n_i, n_i], True = may attend), for
    # tree verify (or one [B, N, N] tensor when every request has N). None means causal.
    # Attention to the cached prefix is always allowed.
    custom_masks: list[torch.Tensor] | torch.Tensor | None = None
    logit_rows: torch.Tensor | None = None  # [R] rows of T whose logits are wanted
    # DECODE only (tree drafting): [B, d] slots of positions [prefix_b, prefix_b + d), a
    # branch's draft ancestors then the new token itself; positions below prefix_b come
    # from the table row as usual, so the branches of one request share it uncopied.
    draft_tail: torch.Tensor | None = None
    # [B] int64 prefix lengths on the device, when the host does not know them yet (a
    # speculative step launched before the previous one is read back: spec/pipeline.py);
    # prefix_lens then holds stale values. Graph replays copy these on the device; an
    # eager forward reads them back first (`settle_prefix`).
    device_prefix: torch.Tensor | None = None
    attn_meta: object = field(default=None, repr=False)  # the backend's, per forward

    def settle_prefix(self) -> None:
        """Make prefix_lens true for an eager forward's host-built metadata: read
        device_prefix back (a sync; pipelined steps run eagerly only on a CPU)."""
        if self.device_prefix is not None:
            self.prefix_lens, self.device_prefix = self.device_prefix.tolist(), None

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def seq_lens(self) -> list[int]:
        extra = self.draft_tail.shape[1] if self.draft_tail is not None else 1
        return [p + e - 1 + extra for p, e in zip(self.prefix_lens, self.extend_lens)]
