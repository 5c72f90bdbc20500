"""The contract every EAGLE-family draft model meets (EAGLE-2, EAGLE-3, MTP).

A draft model is a small network that reads the target's per-token features plus the
next token and predicts the token after it. The proposer drives all of them through
`forward` and `compute_logits` alone; what differs is declared by attributes:
  * `feature_mode`: "final" = the target's final normed hidden [T, H_target] (EAGLE-2,
    MTP); "aux" = the target's residual stream before `aux_layers`, concatenated in that
    order [T, len(aux_layers) * H_target] (EAGLE-3);
  * `token_map`: draft logit index -> target token id when the draft's vocabulary is a
    subset (EAGLE-3's draft vocab, FR-Spec hot tokens); None = identity.
The embedding (and for EAGLE-2 / MTP the lm_head) is the target's own module, attached
after loading by `share`. This file knows nothing about checkpoints' layouts
(`draft_loader.py`) or about scheduling (`spec/`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from specserve import kernels
from specserve.core import parallel
from specserve.core.forward_batch import ForwardBatch
from specserve.core.quant import QuantWeight
from specserve.models.layers import cpu_layout, gpu_layout
from specserve.models.llama import LlamaConfig, LlamaForCausalLM
from specserve.models.quant_linear import quant_linear
from specserve.models.rope import RotaryEmbedding
from specserve.models.token_map import cut_head


class DraftModel(nn.Module, ABC):
    config: LlamaConfig  # the draft's own: num_layers = its attention layers = its KV pool's
    feature_mode: str = "final"
    aux_layers: tuple[int, ...] = ()  # "before layer i" indices for the target's aux_layers
    token_map: torch.Tensor | None = None  # [draft_vocab] int64 on the model's device

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)
        self.embed_tokens: nn.Embedding | None = None  # the target's, set by `share`
        # The target's head (or a truncated copy), set by `share`, unless a subclass sets
        # owns_lm_head and builds its own [draft_vocab, H] head (EAGLE-3).
        self.lm_head: nn.Linear | None = None
        self.owns_lm_head = False
        self.head_blocks: QuantWeight | None = None  # the head in GGUF blocks (models/gguf_serve.py `quantize_draft`)

    @abstractmethod
    def forward(self, fb: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fb.input_ids: target token ids [T]; hidden [T, F]: target features or the draft's
        own previous h_next [T, H]. Returns (h_logits [T, H], h_next [T, H])."""

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 [R, draft_vocab] for h [R, H]: for up to 32 rows on CUDA the half
        logits widened in the GEMV's own launch (not while training: it has no backward)."""
        assert self.lm_head is not None, "the head is the draft's own or attached by `share`"
        if self.head_blocks is not None and not h.is_cuda:
            return parallel.gather_vocab(quant_linear(h, self.head_blocks).float())
        if kernels.use_gemv(h) and not torch.is_grad_enabled():
            return parallel.gather_vocab(kernels.gemv(h, self.lm_head.weight, out_dtype=torch.float32))
        return parallel.gather_vocab(F.linear(h, self.lm_head.weight).float())

    # -- checkpoint names <-> parameter names (overridden by layouts that rename) ---------
    def param_name(self, ckpt_name: str) -> str | None:
        """Our parameter for a checkpoint tensor (HF q/k/v, gate/up names kept), or None to
        skip it. A name that maps to no parameter is reported as unexpected."""
        return ckpt_name

    def checkpoint_name(self, param_name: str) -> str:
        """Inverse of `param_name`, for error messages."""
        return param_name

    # -- after loading -------------------------------------------------------------------
    def finalize(self, device: torch.device, dtype: torch.dtype) -> None:
        """After weights are loaded, before `share`: GEMV layout on CPU, RoPE tables."""
        if device.type == "cpu":
            cpu_layout(self, dtype)
        else:
            gpu_layout(self)
        self.rotary.build(device, torch.float32 if dtype == torch.float32 else dtype)

    def build_cpu_stack(self) -> None:
        """Once its projections hold blocks on the CPU (models/gguf_serve.py `quantize_draft`):
        the draft's layers in one C call where its kind has one (EAGLE-3), else nothing."""

    def share(self, target: LlamaForCausalLM, token_map: torch.Tensor | None) -> None:
        """Take the target's embedding (same tensor) and, unless the draft owns a head, its
        lm_head: shared as is, or with a token map a copy truncated to those rows."""
        self.embed_tokens = target.model.embed_tokens
        if self.owns_lm_head:
            return
        if token_map is None:
            self.lm_head = target.lm_head
            return
        self.lm_head, self.token_map = cut_head(target.lm_head.weight, token_map)  # a copy: [draft_vocab, H]
