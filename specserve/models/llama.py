"""One model file for the Llama family: Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3, SmolLM2.

The differences are config switches: q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3),
tied embeddings (SmolLM2, small Qwens), RoPE scaling (Llama 3.1). The model knows
nothing about serving: it takes a ForwardBatch and returns final hidden states; the
attention backend named by the batch does the attention. It can also return the
residual stream at chosen layers (EAGLE-3's auxiliary hidden states).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.models.layers import Linear, RMSNorm
from specserve.models.rope import RotaryEmbedding, apply_rope
from specserve.runner.forward_batch import ForwardBatch

logger = logging.getLogger("specserve")

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class LlamaConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, d: dict) -> "LlamaConfig":
        arch = (d.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"architecture {arch} is not supported (supported: {', '.join(ARCHITECTURES)})")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (only silu)")
        heads = d["num_attention_heads"]
        theta, scaling = _rope_params(d)
        return cls(
            architecture=arch, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
            num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=_max_positions(d),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", arch == "Qwen2ForCausalLM"),
            qk_norm=arch == "Qwen3ForCausalLM",
        )


def _rope_params(d: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from transformers 4 (`rope_theta`, `rope_scaling`) or 5 (`rope_parameters`)."""
    params = d.get("rope_parameters") or {}
    theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


def _max_positions(d: dict) -> int:
    """Sliding-window attention is not implemented: cap the context at the window instead."""
    n = d.get("max_position_embeddings", 4096)
    window = d.get("sliding_window")
    uses_window = d.get("use_sliding_window", d.get("model_type") == "mistral")
    if window and uses_window and window < n:
        logger.warning("sliding-window attention is not supported: context capped at %d", window)
        n = window
    return n


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, fb: ForwardBatch, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, kv = self.heads, self.kv_heads
        qkv = self.qkv_proj(x).view(-1, h + 2 * kv, self.head_dim)  # [T, H + 2 kvH, D]
        qk, v = qkv[:, :h + kv], qkv[:, h + kv:]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])], dim=1)
        qk = apply_rope(qk, *rope)  # queries and keys rotated together
        q, k = qk[:, :h], qk[:, h:]
        out = fb.attn_backend.forward(q, k, v, self.layer_id, fb, self.scale)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), fb, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.aux_layers: tuple[int, ...] = ()  # residual stream captured *before* these layers

    def forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final normed hidden [T, hidden] and the aux hidden states asked for."""
        x = self.model.embed_tokens(fb.input_ids)
        rope = self.model.rotary.lookup(fb.positions)
        aux = []
        for i, layer in enumerate(self.model.layers):
            if i in self.aux_layers:
                aux.append(x)
            x = layer(x, fb, rope)
        return self.model.norm(x), aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def finalize(self, device: torch.device, dtype: torch.dtype) -> None:
        """After weights are loaded: tie the head if asked and build RoPE tables."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if device.type == "cpu":
            for module in self.modules():
                if isinstance(module, Linear):
                    module.use_gemv_layout()
        self.model.rotary.build(device, torch.float32 if dtype == torch.float32 else dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, stacking q/k/v and gate/up into the fused projections."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            target, offset = _fused_target(name, self.config)
            if target not in params:
                if self.config.tie_word_embeddings and name == "lm_head.weight":
                    continue
                raise ValueError(f"unexpected tensor {name} in checkpoint")
            param = params[target]
            rows = tensor.shape[0]
            with torch.no_grad():
                param[offset:offset + rows].copy_(tensor.to(param.dtype))
            loaded.add(f"{target}@{offset}")
        _check_complete(self, loaded)


_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}


def _fused_target(name: str, cfg: LlamaConfig) -> tuple[str, int]:
    """Map an HF tensor name to (our parameter name, first row it fills)."""
    for proj, idx in _QKV.items():
        if f".self_attn.{proj}." in name:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            return name.replace(proj, "qkv_proj"), [0, q, q + kv][idx]
    if ".mlp.gate_proj." in name:
        return name.replace("gate_proj", "gate_up_proj"), 0
    if ".mlp.up_proj." in name:
        return name.replace("up_proj", "gate_up_proj"), cfg.intermediate_size
    return name, 0


def _check_complete(model: LlamaForCausalLM, loaded: set[str]) -> None:
    cfg = model.config
    expected = set()
    for name, _ in model.named_parameters():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        if "qkv_proj" in name:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            expected |= {f"{name}@0", f"{name}@{q}", f"{name}@{q + kv}"}
        elif "gate_up_proj" in name:
            expected |= {f"{name}@0", f"{name}@{cfg.intermediate_size}"}
        else:
            expected.add(f"{name}@0")
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
