"""MTP draft layers stored in the target's own checkpoint (DeepSeek NextN, MiMo).

DeepSeek-style NextN (`num_nextn_predict_layers` >= 1, tensors `model.layers.{L}.*` with
L = num_hidden_layers):
    x = eh_proj(cat(enorm(embed), hnorm(hidden)));  out = decoder layer (with input norm)
    h_logits = h_next = shared_head.norm(out);  logits: the target's lm_head
MiMo (`model.mtp_layers.{i}.*`, a Qwen2 decoder layer):
    x = input_proj(cat(hidden_layernorm(hidden), token_layernorm(embed)))   (reverse order)
    with the embedding zeroed at position 0;  out = decoder layer
    h_logits = h_next = final_layernorm(out);  logits: the target's lm_head
`hidden` is the target's final normed hidden, or at later draft steps the draft's own
normed output: like the target's feature, and what SGLang's logits processor captures
for MTP (EAGLE heads instead feed back their pre-norm stream). Only MTP layer 0
is used. The config is the trunk's with one layer (attention bias follows the trunk).
`shared_head.head` and `embed_tokens` copies in the file are skipped (the target's are
shared), as are the trunk's own tensors.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from specserve.core.forward_batch import ForwardBatch
from specserve.models.draft_model import DraftModel
from specserve.models.layers import Linear, RMSNorm
from specserve.models.llama import DecoderLayer, LlamaConfig

MIMO = "MiMoForCausalLM"


def checkpoint_names(model_dir: Path) -> list[str]:
    """Tensor names of every *.safetensors file in a directory (headers only)."""
    names: list[str] = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            names += list(sf.keys())
    return names


def has_mtp_layers(model_dir: Path) -> bool:
    """True when a trunk checkpoint carries MTP layers usable as an EAGLE draft."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        return False
    cfg = json.loads(path.read_text())
    if (cfg.get("num_nextn_predict_layers") or 0) > 0:
        return True
    arch = (cfg.get("architectures") or [""])[0]
    return arch == MIMO and any(n.startswith("model.mtp_layers.") for n in checkpoint_names(model_dir))


class _PrefixRenamed(DraftModel):
    """Checkpoint `{prefix}{rest}` -> our `{ours}{rest}` by the first matching rule (ours
    None: skip). Names no rule matches (the trunk, other MTP layers) are skipped."""

    rules: tuple[tuple[str, str | None], ...]  # (checkpoint prefix, our prefix or None)

    def param_name(self, ckpt_name: str) -> str | None:
        for theirs, ours in self.rules:
            if ckpt_name.startswith(theirs):
                return None if ours is None else ours + ckpt_name[len(theirs):]
        return None

    def checkpoint_name(self, param_name: str) -> str:
        for theirs, ours in self.rules:
            if ours is not None and param_name.startswith(ours):
                return theirs + param_name[len(ours):]
        return param_name


class DeepseekNextN(_PrefixRenamed):
    feature_mode = "final"

    def __init__(self, cfg: LlamaConfig, layer_index: int) -> None:
        """cfg: the trunk's with num_layers = 1; layer_index: the checkpoint index (L)."""
        super().__init__(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.decoder = DecoderLayer(cfg, 0)
        self.shared_head = nn.ModuleDict({"norm": RMSNorm(h, eps)})
        p = f"model.layers.{layer_index}."
        self.rules = (
            (p + "shared_head.head.", None), (p + "embed_tokens.", None),  # the target's are shared
            *((p + n, n) for n in ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")),
            (p, "decoder."),
        )

    def forward(self, fb: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.embed_tokens is not None, "`share` attaches the target's embedding"
        x = torch.cat([self.enorm(self.embed_tokens(fb.input_ids)), self.hnorm(hidden)], dim=-1)
        out = self.decoder(self.eh_proj(x), fb, self.rotary.at(fb.positions))  # [T, 2H] -> [T, H]
        normed = self.shared_head["norm"](out)
        return normed, normed


class MiMoMTP(_PrefixRenamed):
    feature_mode = "final"

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.token_layernorm, self.hidden_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.input_proj = Linear(2 * h, h, bias=False)
        self.final_layernorm = RMSNorm(h, eps)
        self.mtp_block = DecoderLayer(cfg, 0)
        p = "model.mtp_layers.0."
        self.rules = (
            *((p + n, n) for n in ("token_layernorm.", "hidden_layernorm.", "input_proj.", "final_layernorm.")),
            (p, "mtp_block."),
        )

    def forward(self, fb: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.embed_tokens is not None, "`share` attaches the target's embedding"
        embeds = self.embed_tokens(fb.input_ids)
        embeds = embeds.masked_fill((fb.positions == 0)[:, None], 0.0)  # MiMo masks position 0
        x = torch.cat([self.hidden_layernorm(hidden), self.token_layernorm(embeds)], dim=-1)
        out = self.mtp_block(self.input_proj(x), fb, self.rotary.at(fb.positions))
        normed = self.final_layernorm(out)
        return normed, normed
