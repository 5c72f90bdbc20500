"""Checkpoints in which an EAGLE / EAGLE-3 / MTP draft predicts the target perfectly.

Acceptance tests need a draft that is right whenever its inputs are wired right: a wrong
position, a feature paired with the wrong token or a branch attending to the wrong KV
then collapses the accept length, while greedy equality alone would never notice.

The target is a one-layer Llama whose next token depends only on the current token:
q/k projections are zero with a large constant bias, so after RoPE every query scores
its own key (relative distance 0) far above any other and attention returns the token's
own value. Embedding rows have unit RMS and the input / final norms are ones, so
RMSNorm(e) == e up to eps. A draft that rebuilds this computation on token p+1 (fed
at draft position p) therefore predicts exactly what the target predicts there:
  * EAGLE-2: fc = [I, 0] picks the token embedding; layer 0 is the target's layer (it has
    no input norm, which is the identity here); the target head without final norm
    (norm weights are ones, so that is a positive rescaling: same argmax);
  * EAGLE-3: q/k/v read only the normed embedding half of [embed, hidden]; the residual
    is zeroed (vLLM's norm_before_residual with a zero hidden_norm, since at later draft
    steps the incoming hidden is the draft's own output), and the residual the target has
    but the midlayer lacks (the embedding) is made negligible by scaling the target's
    o_proj by 1e5, so this draft is right up to rare near-ties;
  * MTP (DeepSeek NextN and MiMo): the projection picks the embedding; the MTP layer is a
    copy of the target's layer and its norm the target's final norm.
The self-attention trick still needs each token's own K/V at the right slot and a query
position equal to its key position: exactly what the draft wiring must get right.
The head is scaled up so the draft's distributions are peaked and the reranked tree
keeps the whole argmax chain.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.unit.model_utils import save_tiny_hf

VOCAB = 49152  # SmolLM2's, so its tokenizer can be borrowed
H = 64
BIAS = 15.0  # q = k = 15 in every dim: scores 900 at distance 0, <= 842 elsewhere (<= 400 apart)
O_SCALE = 1e5


def make_target(path: Path, eagle3: bool = False, mimo: bool = False) -> Path:
    save_tiny_hf("llama", path, vocab_size=VOCAB, num_hidden_layers=1, attention_bias=True,
                 max_position_embeddings=1024)
    w = load_file(path / "model.safetensors")
    del w["model.layers.0.self_attn.o_proj.bias"]  # HF Llama's attention_bias adds it; Qwen2-style q/k/v bias is ours
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(VOCAB, H, generator=g)
    w["model.embed_tokens.weight"] = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()
    w["model.layers.0.input_layernorm.weight"] = torch.ones(H)
    w["model.norm.weight"] = torch.ones(H)
    for p in ("q", "k"):
        w[f"model.layers.0.self_attn.{p}_proj.weight"].zero_()
        w[f"model.layers.0.self_attn.{p}_proj.bias"].fill_(BIAS)
    w["lm_head.weight"] = w["lm_head.weight"] * 200
    if eagle3:
        w["model.layers.0.self_attn.o_proj.weight"] = w["model.layers.0.self_attn.o_proj.weight"] * O_SCALE
    save_file(w, path / "model.safetensors")
    if mimo:
        _edit_config(path, architectures=["MiMoForCausalLM"], model_type="mimo", num_nextn_predict_layers=1)
    return path


def _layer(w: dict, prefix: str, with_input_norm: bool = True) -> dict:
    """The target's layer-0 tensors renamed under `prefix`."""
    out = {}
    for name, t in w.items():
        if name.startswith("model.layers.0."):
            rest = name[len("model.layers.0."):]
            if rest.startswith("input_layernorm") and not with_input_norm:
                continue
            out[prefix + rest] = t.clone()
    return out


def _draft_config(target: Path, **fields) -> dict:
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(num_hidden_layers=1, **fields)
    return cfg


def _write(path: Path, tensors: dict, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config))
    return path


def perfect_eagle2(path: Path, target: Path) -> Path:
    w = load_file(target / "model.safetensors")
    t = _layer(w, "layers.0.", with_input_norm=False)
    t["fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)
    t["fc.bias"] = torch.zeros(H)
    return _write(path, t, _draft_config(target, architectures=["LlamaForCausalLMEagle"], bias=True))


def perfect_eagle3(path: Path, target: Path) -> Path:
    """Full draft vocabulary under a permutation, so d2t is exercised."""
    w = load_file(target / "model.safetensors")
    t = {}
    for name, x in _layer(w, "midlayer.").items():
        if name.endswith("_proj.weight") and ".self_attn." in name and "o_proj" not in name:
            x = torch.cat([x, torch.zeros_like(x)], dim=1)  # read only the embedding half
        t[name] = x
    t["midlayer.hidden_norm.weight"] = torch.zeros(H)  # with norm_before_residual: residual 0
    t["fc.weight"] = torch.zeros(H, 3 * H)
    t["norm.weight"] = w["model.norm.weight"].clone()
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))
    t["lm_head.weight"] = w["lm_head.weight"][perm].clone()  # draft row i is target token perm[i]
    t["d2t"] = perm - torch.arange(VOCAB)
    t["t2d"] = torch.ones(VOCAB, dtype=torch.bool)
    cfg = _draft_config(target, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=VOCAB,
                        norm_before_residual=True,
                        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 0, 0]})
    return _write(path, t, cfg)


def perfect_mtp_deepseek(target: Path) -> Path:
    w = load_file(target / "model.safetensors")
    w.update(_layer(w, "model.layers.1."))
    w["model.layers.1.enorm.weight"] = torch.ones(H)
    w["model.layers.1.hnorm.weight"] = torch.ones(H)
    w["model.layers.1.eh_proj.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)
    w["model.layers.1.shared_head.norm.weight"] = w["model.norm.weight"].clone()
    save_file(w, target / "model.safetensors")
    _edit_config(target, num_nextn_predict_layers=1)
    return target


def perfect_mtp_mimo(target: Path) -> Path:
    w = load_file(target / "model.safetensors")
    p = "model.mtp_layers.0."
    w.update(_layer(w, p))
    w[p + "token_layernorm.weight"] = torch.ones(H)
    w[p + "hidden_layernorm.weight"] = torch.ones(H)
    w[p + "input_proj.weight"] = torch.cat([torch.zeros(H, H), torch.eye(H)], dim=1)  # [hidden, embed]
    w[p + "final_layernorm.weight"] = w["model.norm.weight"].clone()
    save_file(w, target / "model.safetensors")
    return target


def _edit_config(path: Path, **fields) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(fields)
    (path / "config.json").write_text(json.dumps(cfg))
