"""EAGLE-1/2 draft head (`LlamaForCausalLMEagle`, the cnets1 layout).

    x = fc(cat(embed(ids), hidden))          fc: [H, 2H], bias unless config "bias": false
    x = decoder layers (layer 0 has no input_layernorm)
    h_logits = h_next = x                    (no final norm) -> the target's lm_head

`hidden` is always H wide: the target's final normed hidden, or the draft's own output
fed back at later draft steps. Checkpoint names are our parameter names (`fc.*`,
`layers.{i}.*`); an `embed_tokens.weight` in the file (a frozen copy of the target's) is
skipped. Loading and sharing are `draft_loader.py`'s.
"""
from __future__ import annotations

import torch
from torch import nn

from specserve.core.forward_batch import ForwardBatch
from specserve.models.draft_model import DraftModel
from specserve.models.layers import Linear
from specserve.models.llama import DecoderLayer, LlamaConfig


class LlamaForCausalLMEagle(DraftModel):
    feature_mode = "final"

    def __init__(self, cfg: LlamaConfig, fc_bias: bool) -> None:
        super().__init__(cfg)
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, input_norm=i > 0) for i in range(cfg.num_layers))

    def forward(self, fb: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.embed_tokens is not None, "`share` attaches the target's embedding"
        x = self.fc(torch.cat([self.embed_tokens(fb.input_ids), hidden], dim=-1))  # [T, 2H] -> [T, H]
        rope = self.rotary.at(fb.positions)
        for layer in self.layers:
            x = layer(x, fb, rope)
        return x, x

    def param_name(self, ckpt_name: str) -> str | None:
        return None if ckpt_name == "embed_tokens.weight" else ckpt_name
