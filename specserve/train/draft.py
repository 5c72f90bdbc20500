"""The trainable draft head: the inference classes themselves, unrolled over TTT steps.

The head is a `LlamaForCausalLMEagle3` / `LlamaForCausalLMEagle` (models/eagle3.py,
models/eagle.py) with fp32 trainable parameters, so training and inference share one
forward and one set of parameter names. Only attention differs: the inference forward
calls `fb.attn_backend`, and training hands it `TTTAttention`, a differentiable dense
backend over a padded [B, T] grid. The target's embedding (and EAGLE-2's lm_head) is the
target's own module, frozen. Fused Triton kernels are switched off inside the unroll
(they have no backward); the torch paths they replace are their test oracles.

Training-time test (EAGLE-3's TTT; the same unroll serves EAGLE-2). Step j at index i
plays the draft's depth-j forward of a chain rooted at position i:
    step 0:  hidden = target feature f_i, token t_{i+1}, position i      -> predicts t_{i+2}
    step j:  hidden = step j-1's h_next at i, token t_{i+1+j}, position i + j  -> t_{i+2+j}
and it attends to the step-0 keys of indices <= i (draft KV computed from true features,
which inference holds for every committed position <= i) plus the keys of steps 1..j at
index i (its own chain's ancestors and itself). That is exactly what inference sees: the
root pairs (f_{kv_len-1}, t_{kv_len}) and depth-d nodes sit at position kv_len + d - 1
(spec/eagle/proposer.py, tree_draft.py), each attending to the prefix plus its real ancestors. It
is SpecForge's TTT mask without the diagonal it blanks out of the step-0 block at every
step (SpecForge PR 245, EAGLE issue 247): inference never hides a committed position.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from specserve import kernels
from specserve.attention.base import AttentionBackend
from specserve.core.forward_batch import ForwardBatch, ForwardMode, KVStore
from specserve.models.draft_layouts import eagle2_config, eagle3_config, write_checkpoint
from specserve.models.draft_model import DraftModel
from specserve.models.eagle import LlamaForCausalLMEagle
from specserve.models.eagle3 import LlamaForCausalLMEagle3
from specserve.models.layers import Linear, RMSNorm
from specserve.models.llama import LlamaConfig, LlamaForCausalLM
from specserve.train.vocab import DraftVocab

EAGLE3, EAGLE2 = "EAGLE3", "EAGLE"
_TRUNK = "LlamaForCausalLM"  # the decoder layers of both heads follow the Llama trunk


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default capture points, before-layer indices (2, L//2, L-3): the same
    default `draft_loader` uses when a config names none (outputs of layers 1, L/2-1, L-4)."""
    layers = (2, num_layers // 2, num_layers - 3)
    if any(not 0 <= i <= num_layers for i in layers):
        raise ValueError(f"EAGLE3 needs a target with at least 3 layers (aux layers {layers})")
    return layers


def head_config(target_cfg: dict, algorithm: str, vocab: DraftVocab | None,
                aux_layers: tuple[int, ...], save_dtype: torch.dtype) -> dict:
    """The head's config.json: the published layout's, with the aux layers written out
    (as layer-output ids, i.e. before-layer index - 1) so loaders need no default."""
    common = {"tie_word_embeddings": False, "attention_bias": False,
              "torch_dtype": str(save_dtype).removeprefix("torch.")}
    if algorithm == EAGLE3:
        assert vocab is not None, "an EAGLE-3 head has a draft vocabulary"
        return eagle3_config(target_cfg, vocab.size, [i - 1 for i in aux_layers]) | common
    return eagle2_config(target_cfg, bias=True) | common


def build_draft(head_cfg: dict, algorithm: str, target: LlamaForCausalLM, vocab: DraftVocab | None,
                aux_layers: tuple[int, ...], max_positions: int, seed: int) -> DraftModel:
    """A freshly initialised fp32 head on the target's device sharing its embedding (and
    EAGLE-2's head); RoPE tables cover `max_positions` (TTT runs past the last position)."""
    cfg = LlamaConfig.from_hf({**head_cfg, "architectures": [_TRUNK]})
    cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, max_positions))
    device = target.model.embed_tokens.weight.device
    draft: DraftModel
    if algorithm == EAGLE3:
        assert vocab is not None, "an EAGLE-3 head has a draft vocabulary"
        eagle3 = LlamaForCausalLMEagle3(cfg, target.config.hidden_size, vocab.size, aux_layers)
        _init_weights(eagle3, seed)
        with torch.no_grad():  # start from the target's own output rows for the draft ids
            assert eagle3.lm_head is not None  # built with draft_vocab_size: its own head
            eagle3.lm_head.weight.copy_(target.lm_head.weight[vocab.ids.to(device)].float())
            eagle3.get_buffer("d2t").copy_(vocab.d2t)
        draft = eagle3
    else:
        draft = LlamaForCausalLMEagle(cfg, fc_bias=True)
        _init_weights(draft, seed)
    draft = draft.to(device=device, dtype=torch.float32)
    draft.rotary.build(device, torch.float32)
    draft.share(target, None)
    assert draft.embed_tokens is not None  # `share` attached the target's
    draft.embed_tokens.requires_grad_(False)
    if not draft.owns_lm_head:
        assert draft.lm_head is not None  # `share` attached the target's
        draft.lm_head.requires_grad_(False)
    return draft


def _init_weights(draft: nn.Module, seed: int) -> None:
    """Llama's init: N(0, 0.02) matrices, zero biases, unit norms (deterministic per seed)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in draft.modules():
            if isinstance(module, (Linear, nn.Linear)):
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.02)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)


def trainable(draft: DraftModel) -> dict[str, nn.Parameter]:
    """The head's own parameters by name (the shared target modules excluded)."""
    return {n: p for n, p in draft.named_parameters() if p.requires_grad}


# -- the unroll ------------------------------------------------------------------------------

class TTTAttention(AttentionBackend):
    """Dense differentiable attention over a padded [B, T] grid, one call per TTT step and
    layer (module docstring for the mask). Padding sits after each sequence's end, so the
    causal step-0 part never lets a real query see it."""

    pooled_kv = False  # keys and values live in self.keys, per TTT step

    def __init__(self, batch: int, seqlen: int) -> None:
        self.batch, self.seqlen = batch, seqlen
        self.keys: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # layer -> per step (k, v)

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        pass

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int,
                fb: ForwardBatch, scale: float) -> torch.Tensor:
        # pooled_kv is False, so callers always pass this step's k and v (there is no pool to read)
        assert k is not None and v is not None
        b, t = self.batch, self.seqlen
        heads, dim = q.shape[1], q.shape[2]
        q = q.view(b, t, heads, dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(b, t, -1, dim).transpose(1, 2)  # [B, kvH, T, D]
        v = v.view(b, t, -1, dim).transpose(1, 2)
        steps = self.keys.setdefault(layer_id, [])
        steps.append((k, v))
        if len(steps) == 1:  # step 0: plain causal attention, as inference's extend
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                 enable_gqa=heads != k.shape[1])
        else:
            out = ttt_attention(q, steps, scale)
        return out.transpose(1, 2).reshape(b * t, heads * dim)


def ttt_attention(q: torch.Tensor, steps: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
    """q [B, H, T, D] of step j = len(steps) - 1 over the causal step-0 keys and the
    same-index keys of steps 1..j; k/v [B, kvH, T, D] (query head h reads kv head h // G)."""
    b, heads, t, d = q.shape
    kv_heads = steps[0][0].shape[1]
    qg = q.reshape(b, kv_heads, heads // kv_heads, t, d)  # [B, kvH, G, T, D]
    k0, v0 = (x.unsqueeze(2) for x in steps[0])  # [B, kvH, 1, T, D]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    s0 = (qg @ k0.transpose(-1, -2)).float().masked_fill(~causal, float("-inf"))  # [B, kvH, G, T, T]
    diag = torch.stack([(qg.float() * k.unsqueeze(2).float()).sum(-1) for k, _ in steps[1:]], -1)  # [.., T, j]
    p = torch.softmax(torch.cat([s0 * scale, diag * scale], dim=-1), dim=-1)
    out = p[..., :t].to(v0.dtype) @ v0
    for m, (_, v) in enumerate(steps[1:]):
        out = out + p[..., t + m, None].to(v.dtype) * v.unsqueeze(2)
    return out.reshape(b, heads, t, d)


def unroll(draft: DraftModel, features: torch.Tensor, ids: torch.Tensor,
           steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(h_logits, h_next), each [B, T, H], for TTT steps 0..steps-1. features [B, T, F]:
    the target's; ids [B, T]: the sequences (step j reads token t_{i+1+j} at index i)."""
    b, t = ids.shape
    backend = TTTAttention(b, t)
    hidden = features.reshape(b * t, -1)
    index = torch.arange(t, device=ids.device).expand(b, t)
    outs = []
    with kernels.fused_kernels(False):
        for j in range(steps):
            fb = _grid_batch(shift_left(ids, 1 + j).reshape(-1), (index + j).reshape(-1), backend)
            h_logits, h_next = draft(fb, hidden)
            outs.append((h_logits.view(b, t, -1), h_next.view(b, t, -1)))
            hidden = h_next
    return outs


def shift_left(x: torch.Tensor, n: int, fill: int = 0) -> torch.Tensor:
    """x [B, T] moved n places left along T, `fill` entering at the right."""
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, :x.shape[1] - n] = x[:, n:]
    return out


def _grid_batch(ids: torch.Tensor, positions: torch.Tensor, backend: TTTAttention) -> ForwardBatch:
    """A ForwardBatch carrying only what the draft forward reads (ids, positions, backend)."""
    empty = ids.new_zeros(0)
    no_pool = cast(KVStore, None)  # TTTAttention keeps each step's K/V itself (pooled_kv = False)
    return ForwardBatch(ForwardMode.EXTEND, ids, positions, empty, empty, [], [], empty, no_pool, backend)


# -- the published layout ----------------------------------------------------------------------

def checkpoint_tensors(draft: DraftModel, vocab: DraftVocab | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's tensors under their published names: fused q/k/v and gate/up split back
    into HF names, weights in `dtype`, EAGLE-3's d2t (int64) and t2d (bool) added."""
    cfg = draft.config
    out = {}
    for name, p in trainable(draft).items():
        for ckpt, tensor in _split_fused(name, p.detach(), cfg):
            out[ckpt] = tensor.to("cpu", dtype).contiguous()
    if vocab is not None:
        out |= {"d2t": vocab.d2t, "t2d": vocab.t2d}
    return out


def _split_fused(name: str, t: torch.Tensor, cfg: LlamaConfig) -> list[tuple[str, torch.Tensor]]:
    """Inverse of llama.py's loading: qkv_proj -> q/k/v_proj rows, gate_up_proj -> gate/up."""
    if ".qkv_proj." in name:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        parts = t.split([q, kv, kv])
        return [(name.replace("qkv_proj", p), x) for p, x in zip(("q_proj", "k_proj", "v_proj"), parts)]
    if ".gate_up_proj." in name:
        gate, up = t.split([cfg.intermediate_size, cfg.intermediate_size])
        return [(name.replace("gate_up_proj", "gate_proj"), gate), (name.replace("gate_up_proj", "up_proj"), up)]
    return [(name, t)]


def read_head(path: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """A head in the published layout (`save_head`'s, or any checkpoint the loader reads
    under HF names): its tensors by checkpoint name, and with EAGLE-3's d2t its draft
    vocabulary's target ids [N] (i + d2t[i]), else None."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"--init-from {path}: no .safetensors checkpoint there")
    tensors = {k: v for f in files for k, v in load_file(f).items()}
    d2t = tensors.get("d2t")
    ids = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.long() if d2t is not None else None
    return tensors, ids


def specserve_keys(path: Path) -> dict:
    """The specserve_* settings of a head's config.json (its default trees)."""
    config = json.loads((path / "config.json").read_text())
    return {k: v for k, v in config.items() if k.startswith("specserve_")}


def load_trainable(params: dict[str, nn.Parameter], tensors: dict[str, torch.Tensor], cfg: LlamaConfig,
                   path: Path) -> None:
    """Every trainable parameter from a head's checkpoint tensors (`read_head`): q/k/v and
    gate/up fused back as llama.py loads them (`_split_fused`'s inverse)."""
    with torch.no_grad():
        for name, p in params.items():
            names = [ckpt for ckpt, _ in _split_fused(name, p, cfg)]
            missing = [n for n in names if n not in tensors]
            if missing:
                raise ValueError(f"--init-from {path}: the checkpoint has no {missing[0]}")
            value = torch.cat([tensors[n] for n in names]) if len(names) > 1 else tensors[names[0]]
            if value.shape != p.shape:
                raise ValueError(f"--init-from {path}: {name} is {tuple(value.shape)}, this head's is {tuple(p.shape)}")
            p.copy_(value.to(p.dtype))


def save_head(path: Path, draft: DraftModel, vocab: DraftVocab | None, config: dict, dtype: torch.dtype) -> Path:
    """Write the head where `--speculative-draft-model-path` can read it."""
    return write_checkpoint(path, checkpoint_tensors(draft, vocab, dtype), config)
