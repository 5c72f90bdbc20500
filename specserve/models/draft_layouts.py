"""Random EAGLE-2 / EAGLE-3 / MTP checkpoints in the published layouts, next to a target.

The tensor names and config fields are exactly the published ones (the internals note,
section 3). Tensors are random: weights N(0, scale^2), norms 1 + noise and biases
non-zero, so a tensor loaded into the wrong place changes the outputs. Tests build their
synthetic drafts here; `specserve bench spec --random-head` measures what the drafting
machinery costs per step with a head of the real layout and size. The config builders
and `write_checkpoint` are also how `specserve train-draft` writes its trained heads.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


class _Gen:
    """Random tensors from one seeded generator."""

    def __init__(self, seed: int, scale: float = 0.1) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.scale = scale

    def weight(self, *shape: int) -> torch.Tensor:
        return self.scale * torch.randn(*shape, generator=self.g)

    def norm(self, dim: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(dim, generator=self.g)


def _config(target_dir: Path) -> dict:
    return json.loads((Path(target_dir) / "config.json").read_text())


def _dims(cfg: dict) -> tuple[int, int, int, int]:
    """(hidden, intermediate, q rows, kv rows)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    return h, cfg["intermediate_size"], heads * head_dim, (cfg.get("num_key_value_heads") or heads) * head_dim


def _qkv_bias(cfg: dict) -> bool:
    return cfg.get("attention_bias", cfg["architectures"][0] in ("Qwen2ForCausalLM", "MiMoForCausalLM"))


def _attention(p: str, cfg: dict, g: _Gen, in_features: int, bias: bool) -> dict[str, torch.Tensor]:
    h, _, q, kv = _dims(cfg)
    t = {f"{p}self_attn.q_proj.weight": g.weight(q, in_features),
         f"{p}self_attn.k_proj.weight": g.weight(kv, in_features),
         f"{p}self_attn.v_proj.weight": g.weight(kv, in_features),
         f"{p}self_attn.o_proj.weight": g.weight(h, q)}
    if bias:
        t |= {f"{p}self_attn.{n}_proj.bias": g.weight(rows) for n, rows in (("q", q), ("k", kv), ("v", kv))}
    return t


def _mlp(p: str, cfg: dict, g: _Gen) -> dict[str, torch.Tensor]:
    h, inter, _, _ = _dims(cfg)
    return {f"{p}mlp.gate_proj.weight": g.weight(inter, h), f"{p}mlp.up_proj.weight": g.weight(inter, h),
            f"{p}mlp.down_proj.weight": g.weight(h, inter)}


def _decoder_layer(p: str, cfg: dict, g: _Gen, input_norm: bool = True) -> dict[str, torch.Tensor]:
    h = cfg["hidden_size"]
    t = {f"{p}input_layernorm.weight": g.norm(h)} if input_norm else {}
    return t | _attention(p, cfg, g, h, _qkv_bias(cfg)) | {f"{p}post_attention_layernorm.weight": g.norm(h)} \
        | _mlp(p, cfg, g)


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """`path/model.safetensors` + `path/config.json`: how every layout here is written
    (random heads and `specserve train-draft`'s trained ones alike)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's *.safetensors files."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            out |= {n: sf.get_tensor(n) for n in sf.keys()}
    return out


def eagle2_config(target_cfg: dict, bias: bool, num_layers: int = 1,
                  architecture: str = "LlamaForCausalLMEagle") -> dict:
    """The cnets1 config.json: the target's config, one (or `num_layers`) layer(s), and
    `"bias": false` when the checkpoint has no fc.bias (omitted means a bias)."""
    cfg = target_cfg | {"architectures": [architecture], "num_hidden_layers": num_layers}
    if not bias:
        cfg["bias"] = False
    return cfg


def eagle3_config(target_cfg: dict, draft_vocab: int | None, aux_ids: list[int] | None = None,
                  architecture: str = "LlamaForCausalLMEagle3") -> dict:
    """The cnets config.json: the target's config with one layer, `draft_vocab_size` (when
    the head has its own vocabulary) and `eagle_config.eagle_aux_hidden_state_layer_ids`
    (layer-output ids, when given)."""
    cfg = target_cfg | {"architectures": [architecture], "num_hidden_layers": 1}
    if draft_vocab is not None:
        cfg["draft_vocab_size"] = draft_vocab
    if aux_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True}
    return cfg


def save_eagle2(path: Path, target_dir: Path, bias: bool, num_layers: int = 1,
                architecture: str = "LlamaForCausalLMEagle", seed: int = 0, scale: float = 0.1) -> Path:
    """cnets1 layout: fc (+ fc.bias iff bias), layers.{i}.*, no layers.0.input_layernorm,
    no final norm, no lm_head; config "bias": false when there is no fc.bias."""
    cfg = eagle2_config(_config(target_dir), bias, num_layers, architecture)
    g, h = _Gen(seed, scale), cfg["hidden_size"]
    t = {"fc.weight": g.weight(h, 2 * h)} | ({"fc.bias": g.weight(h)} if bias else {})
    for i in range(num_layers):
        t |= _decoder_layer(f"layers.{i}.", cfg, g, input_norm=i > 0)
    return write_checkpoint(path, t, cfg)


def save_eagle3(path: Path, target_dir: Path, draft_vocab: int | None, aux_ids: list[int] | None = None,
                architecture: str = "LlamaForCausalLMEagle3", seed: int = 0, scale: float = 0.1) -> Path:
    """cnets layout: the 15 tensors (fc, midlayer.*, norm, lm_head [draft_vocab, H], d2t
    int64 offsets, t2d bool); without draft_vocab no lm_head / d2t / t2d and no
    `draft_vocab_size`. aux_ids -> eagle_config.eagle_aux_hidden_state_layer_ids."""
    cfg = eagle3_config(_config(target_dir), draft_vocab, aux_ids, architecture)
    vocab, g, h = cfg["vocab_size"], _Gen(seed, scale), cfg["hidden_size"]
    t = {"fc.weight": g.weight(h, 3 * h),
         "midlayer.input_layernorm.weight": g.norm(h), "midlayer.hidden_norm.weight": g.norm(h)}
    t |= _attention("midlayer.", cfg, g, 2 * h, bias=False)
    t |= {"midlayer.post_attention_layernorm.weight": g.norm(h)} | _mlp("midlayer.", cfg, g)
    t["norm.weight"] = g.norm(h)
    if draft_vocab is not None:
        ids = torch.randperm(vocab, generator=g.g)[:draft_vocab].sort().values  # hot target ids
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        t |= {"lm_head.weight": g.weight(draft_vocab, h), "d2t": ids - torch.arange(draft_vocab), "t2d": t2d}
    return write_checkpoint(path, t, cfg)


def _rewrite_target(target_dir: Path, extra: dict[str, torch.Tensor], config: dict) -> Path:
    tensors = read_tensors(target_dir) | extra
    for f in Path(target_dir).glob("*.safetensors*"):
        f.unlink()
    return write_checkpoint(target_dir, tensors, config)


def add_mtp_deepseek(target_dir: Path, seed: int = 0, num_mtp: int = 1) -> Path:
    """DeepSeek NextN: model.layers.{L + j}.{enorm, hnorm, eh_proj, shared_head.{norm, head},
    embed_tokens} + a full decoder layer; config num_nextn_predict_layers."""
    cfg = _config(target_dir)
    g, h, vocab, n = _Gen(seed), cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    extra: dict[str, torch.Tensor] = {}
    for j in range(num_mtp):
        p = f"model.layers.{n + j}."
        extra |= {p + "enorm.weight": g.norm(h), p + "hnorm.weight": g.norm(h),
                  p + "eh_proj.weight": g.weight(h, 2 * h), p + "shared_head.norm.weight": g.norm(h),
                  p + "shared_head.head.weight": g.weight(vocab, h), p + "embed_tokens.weight": g.weight(vocab, h)}
        extra |= _decoder_layer(p, cfg, g)
    return _rewrite_target(target_dir, extra, cfg | {"num_nextn_predict_layers": num_mtp})


def add_mtp_mimo(target_dir: Path, seed: int = 0, num_mtp: int = 1) -> Path:
    """MiMo: model.mtp_layers.{j}.{token_layernorm, hidden_layernorm, input_proj,
    final_layernorm} + a Qwen2 decoder layer; architectures MiMoForCausalLM."""
    cfg = _config(target_dir) | {"architectures": ["MiMoForCausalLM"], "model_type": "mimo",
                                 "num_nextn_predict_layers": num_mtp}
    g, h = _Gen(seed), cfg["hidden_size"]
    extra: dict[str, torch.Tensor] = {}
    for j in range(num_mtp):
        p = f"model.mtp_layers.{j}."
        extra |= {p + "token_layernorm.weight": g.norm(h), p + "hidden_layernorm.weight": g.norm(h),
                  p + "input_proj.weight": g.weight(h, 2 * h), p + "final_layernorm.weight": g.norm(h)}
        extra |= _decoder_layer(p, cfg, g)
    return _rewrite_target(target_dir, extra, cfg)
