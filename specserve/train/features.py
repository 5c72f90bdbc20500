"""The target as teacher: the features inference feeds the draft, and the distributions
the draft must match.

For a padded batch of sequences the target runs one EXTEND forward with the torch
reference attention backend, through the same `LlamaForCausalLM.forward` the engine runs,
so the features are the inference ones: EAGLE-3's residual stream before each of
`aux_layers` concatenated [T, 3H], or EAGLE-2's final normed hidden [T, H] (what
`ModelRunner.forward_with_features` returns). The target's logits are computed only at
the rows the loss reads, softmaxed over the draft vocabulary (EAGLE-3: the distribution
renormalised over the draft's ids, as SpecForge does) or the full vocabulary (EAGLE-2).
Nothing is cached between batches: one forward per training step, under no_grad.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.attention.torch_ref import TorchRefBackend
from specserve.cache.kv_pool import KVPool
from specserve.core.forward_batch import ForwardBatch, ForwardMode
from specserve.models.llama import LlamaForCausalLM


@dataclass
class Taught:
    features: torch.Tensor  # [B, T, F] target dtype; zero past each sequence's end
    probs: torch.Tensor  # [R, V'] float32: the target's next-token distribution of each computed row
    top: torch.Tensor  # [R] int64: the target's argmax there (a target id)
    row_index: torch.Tensor  # [B, T] int64: grid row -> index into probs / top, -1 where not computed


class Teacher:
    def __init__(self, model: LlamaForCausalLM, feature_mode: str, aux_layers: tuple[int, ...] = (),
                 vocab_ids: torch.Tensor | None = None) -> None:
        """feature_mode "aux" (EAGLE-3, before-layer indices `aux_layers`) or "final" (EAGLE-2);
        vocab_ids: the draft vocabulary's target ids (None: the full vocabulary)."""
        if feature_mode not in ("aux", "final"):
            raise ValueError(f"unknown feature mode {feature_mode!r}")
        self.model, self.mode = model, feature_mode
        model.aux_layers = tuple(aux_layers) if feature_mode == "aux" else ()
        self.device = next(model.parameters()).device
        self.dtype = model.model.embed_tokens.weight.dtype
        self.vocab_ids = vocab_ids.to(self.device) if vocab_ids is not None else None
        self.backend = TorchRefBackend()
        self.pool: KVPool | None = None

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor) -> Taught:
        """ids [B, T] (padded), lengths [B], rows [B, T] bool: where distributions are wanted."""
        valid = torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None]  # [B, T]
        hidden, features = self._forward(ids, valid, lengths)  # packed [N, H], [N, F]
        b, t = ids.shape
        feats = features.new_zeros(b, t, features.shape[-1])
        feats[valid] = features
        probs, top = self._distributions(hidden[rows[valid]])
        row_index = torch.full(rows.shape, -1, dtype=torch.int64, device=rows.device)
        row_index[rows] = torch.arange(top.numel(), device=rows.device)  # row-major, as rows[valid]
        return Taught(feats, probs, top, row_index)

    def _forward(self, ids: torch.Tensor, valid: torch.Tensor,
                 lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lens = lengths.tolist()
        n = sum(lens)
        pool = self._pool(n)
        slots = torch.arange(1, n + 1, device=self.device)  # slot 0 is the pool's scratch slot
        table = torch.zeros(ids.shape, dtype=torch.int64, device=self.device)
        table[valid] = slots
        positions = torch.arange(ids.shape[1], device=self.device).expand_as(ids)[valid]
        fb = ForwardBatch(ForwardMode.EXTEND, ids[valid], positions, slots,
                          torch.arange(len(lens), device=self.device), [0] * len(lens), lens,
                          table, pool, self.backend)
        self.backend.init_forward_metadata(fb)
        hidden, aux = self.model(fb)
        return hidden, hidden if self.mode == "final" else torch.cat(aux, dim=-1)

    def _distributions(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs [R, V'], argmax [R]) for the final hidden of the wanted rows [R, H]."""
        logits = self.model.compute_logits(hidden)  # [R, V] float32
        top = logits.argmax(-1)
        if self.vocab_ids is not None:
            logits = logits[:, self.vocab_ids]  # [R, V_draft]
        return torch.softmax(logits, dim=-1), top

    def _pool(self, tokens: int) -> KVPool:
        """A KV pool of at least `tokens` slots, kept and grown across batches."""
        if self.pool is None or self.pool.num_slots < tokens:
            cfg = self.model.config
            self.pool = None  # free the old one first
            self.pool = KVPool(tokens, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        return self.pool
