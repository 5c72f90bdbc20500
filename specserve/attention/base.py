"""The attention backend contract.

A backend turns (q, k, v) of the new tokens into attention outputs over each request's
whole KV (cached prefix + new tokens), and stores the new K/V in the pool. One backend
serves every forward mode:
  * EXTEND / DRAFT_EXTEND: ragged queries, causal over the new tokens;
  * DECODE: one query per request;
  * VERIFY: a tree of queries per request with `ForwardBatch.custom_masks`.
`init_forward_metadata` runs once per forward (not per layer) and may precompute index
and mask tensors into `fb.attn_meta`. CUDA-graph capable backends also implement the
`*_cuda_graph*` hooks: static buffers are allocated once, metadata for a captured batch
size is written into them before replay, so replay reads fresh indices in place.
Shapes: q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim], out [T, num_heads*head_dim].
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from specserve.core.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    supports_cuda_graph: bool = False
    # forward reads the new tokens' K/V from fb.kv_pool after storing them at fb.out_slots:
    # a caller may store them itself (the fused RoPE + KV write) and pass k = v = None
    pooled_kv: bool = True

    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Precompute what every layer's `forward` needs for this batch into fb.attn_meta."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int,
                fb: ForwardBatch, scale: float) -> torch.Tensor:
        """Write k, v at fb.out_slots of layer `layer_id` (None: already there, see
        `pooled_kv`), then attend; return [T, H*D]."""

    # -- CUDA graph hooks (backends with supports_cuda_graph = True) ------------------
    def init_cuda_graph_state(self, max_bs: int, max_tokens_per_req: int, causal: bool = False) -> None:
        raise RuntimeError(f"{type(self).__name__} cannot run inside CUDA graphs")

    def init_prefill_graph_state(self, max_reqs: int = 1) -> None:
        """Static metadata for graphs of up to `max_reqs` requests' EXTEND (a prefill chunk),
        padded past its true length; a backend without it prefills eagerly."""
        raise RuntimeError(f"{type(self).__name__} cannot run inside CUDA graphs")

    def init_metadata_for_capture(self, fb: ForwardBatch) -> None:
        raise RuntimeError(f"{type(self).__name__} cannot run inside CUDA graphs")

    def init_metadata_for_replay(self, fb: ForwardBatch) -> None:
        raise RuntimeError(f"{type(self).__name__} cannot run inside CUDA graphs")

    def init_tail_metadata(self, fb: ForwardBatch, tail_start: torch.Tensor) -> None:
        """DECODE metadata with fb.draft_tail from device tensors alone (tail_start [B] =
        fb.prefix_lens on the device), for tree drafting inside a captured graph."""
        raise RuntimeError(f"{type(self).__name__} cannot build metadata inside CUDA graphs")
