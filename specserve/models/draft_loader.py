"""Build an EAGLE-family draft model from a checkpoint directory, next to a loaded target.

Owns recognising the layout, checking it against the algorithm, the draft's config, and
loading: build on the meta device, materialise once, copy tensors (q/k/v and gate/up
stacked as in llama.py), check completeness, then share the target's embedding (and
lm_head for EAGLE-2 / MTP, truncated by an FR-Spec token map if one is given).

Layouts (see the model files for the math):
  * "eagle2": architectures LlamaForCausalLMEagle / Qwen2ForCausalLMEagle, or an EAGLE
    trainer checkpoint (architectures LlamaForCausalLM) with `fc.weight` + `layers.0.*`;
  * "eagle3": LlamaForCausalLMEagle3 / Qwen2ForCausalLMEagle3, or a trainer checkpoint
    with `midlayer.*`;
  * "mtp": the target's own checkpoint carrying MTP layers (DeepSeek NextN or MiMo).
"""
from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from specserve.models import gguf_serve
from specserve.models import quantization as quantization_mod
from specserve.models.checkpoint import check_complete, load_tensor, loadable_tensors
from specserve.models.draft_model import DraftModel
from specserve.models.eagle import LlamaForCausalLMEagle
from specserve.models.eagle3 import LlamaForCausalLMEagle3
from specserve.models.llama import LlamaConfig, LlamaForCausalLM
from specserve.models.loader import read_hf_config
from specserve.models.mtp import MIMO, DeepseekNextN, MiMoMTP, checkpoint_names, has_mtp_layers

logger = logging.getLogger("specserve")

# Draft architecture -> the trunk architecture its decoder layers follow.
EAGLE2_ARCHITECTURES = {"LlamaForCausalLMEagle": "LlamaForCausalLM", "Qwen2ForCausalLMEagle": "Qwen2ForCausalLM"}
EAGLE3_ARCHITECTURES = {"LlamaForCausalLMEagle3": "LlamaForCausalLM", "Qwen2ForCausalLMEagle3": "Qwen2ForCausalLM"}
_DESCRIBED = {"eagle2": "an EAGLE-2 head", "eagle3": "an EAGLE-3 head", "mtp": "a model with MTP layers"}


def detect_layout(path: Path, hf: dict | None = None, names: list[str] | None = None) -> str:
    """'eagle2', 'eagle3' or 'mtp' (module docstring); ValueError for anything else. Reads
    the config and the safetensors headers only (`hf`, `names` when the caller has them)."""
    hf = read_hf_config(path) if hf is None else hf
    names = checkpoint_names(path) if names is None else names
    if not names:
        raise ValueError(f"{path} has no *.safetensors files")
    arch = (hf.get("architectures") or [""])[0]
    if arch in EAGLE2_ARCHITECTURES:
        return "eagle2"
    if arch in EAGLE3_ARCHITECTURES:
        return "eagle3"
    if any(n.startswith("midlayer.") for n in names):
        return "eagle3"
    if "fc.weight" in names and any(n.startswith("layers.0.") for n in names):
        return "eagle2"
    if has_mtp_layers(path):
        return "mtp"
    raise ValueError(f"{path} is not a draft model this engine knows (architectures {arch!r}): expected "
                     f"{', '.join([*EAGLE2_ARCHITECTURES, *EAGLE3_ARCHITECTURES])}, an EAGLE trainer "
                     "checkpoint, or a model whose checkpoint has MTP layers")


def load_draft(path: Path, target: LlamaForCausalLM, layouts: tuple[str, ...], dtype: torch.dtype,
               device: torch.device, token_map: torch.Tensor | None = None,
               quantization: str | None = None) -> DraftModel:
    """The draft model at `path`, which must have one of `layouts` ('eagle2', 'eagle3',
    'mtp'), sharing `target`'s embedding (and head); `token_map`: FR-Spec hot token ids
    (EAGLE-2 / MTP); `quantization`: its linear layers' (models/quantization.py)."""
    path = Path(path)
    hf = read_hf_config(path)
    names = checkpoint_names(path)
    layout = detect_layout(path, hf, names)
    if layout not in layouts:
        raise ValueError(f"{path} is {_DESCRIBED[layout]}, not {' or '.join(_DESCRIBED[k] for k in layouts)}")
    build = {"eagle2": _build_eagle2, "eagle3": _build_eagle3, "mtp": _build_mtp}[layout]
    draft = build(hf, names, target).to_empty(device=device).to(dtype)
    wq = quantization_mod.resolve(quantization, hf)
    quantization_mod.prepare(draft, wq)
    _load_weights(draft, path, names)
    draft.finalize(device, dtype)
    if layout == "eagle3":
        if draft.token_map is not None:
            _check_token_map(path, draft.token_map, target.config.vocab_size, "d2t")
        if token_map is not None:
            logger.warning("--speculative-token-map is ignored for EAGLE3: EAGLE3 models already have this")
            token_map = None
    elif token_map is not None:
        _check_token_map(path, token_map, target.config.vocab_size, "token map")
    draft.share(target, token_map)
    if quantization is None and _blocks_target(target, device):
        gguf_serve.quantize_draft(draft, target)
        wq = quantization_mod.WeightQuant(gguf_serve.GGUF)
    draft.eval().requires_grad_(False)
    logger.info("Loaded draft %s (%s, %d layer(s), feature %s, quantization %s)", path.name, type(draft).__name__,
                draft.config.num_layers, draft.feature_mode, quantization_mod.describe(draft, wq))
    return draft


def _blocks_target(target: LlamaForCausalLM, device: torch.device) -> bool:
    """Whether the target is served in GGUF blocks on the CPU (its draft then follows)."""
    wq = getattr(target, "weight_quant", None)
    return device.type == "cpu" and wq is not None and wq.method == gguf_serve.GGUF


def _draft_config(hf: dict, architecture: str, names: list[str], target: LlamaForCausalLM) -> LlamaConfig:
    """The draft's LlamaConfig. q/k/v bias: the config's `attention_bias` if set, else
    whether the file has one (a Qwen2-spelled head may or may not). RoPE tables cover the
    target's context, whatever the draft's training config says (SGLang overrides it too)."""
    bias = hf.get("attention_bias", any(n.endswith("self_attn.q_proj.bias") for n in names))
    cfg = LlamaConfig.from_hf({**hf, "architectures": [architecture], "attention_bias": bias})
    if cfg.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft's vocab_size ({cfg.vocab_size}) differs from the target's "
                         f"({target.config.vocab_size})")
    positions = max(cfg.max_position_embeddings, target.config.max_position_embeddings)
    return dataclasses.replace(cfg, max_position_embeddings=positions, tie_word_embeddings=False)


def _check_width(what: str, width: int, target: LlamaForCausalLM) -> None:
    if width != target.config.hidden_size:
        raise ValueError(f"the draft's {what} ({width}) differs from the target's hidden_size "
                         f"({target.config.hidden_size})")


def _build_eagle2(hf: dict, names: list[str], target: LlamaForCausalLM) -> DraftModel:
    arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    cfg = _draft_config(hf, EAGLE2_ARCHITECTURES.get(arch, arch), names, target)
    _check_width("hidden_size", cfg.hidden_size, target)  # reads the target's hidden, shares its head
    with torch.device("meta"):
        return LlamaForCausalLMEagle(cfg, fc_bias=hf.get("bias", True))


def _build_eagle3(hf: dict, names: list[str], target: LlamaForCausalLM) -> DraftModel:
    if hf.get("num_hidden_layers") != 1:
        raise ValueError(f"EAGLE3 currently only supports 1 layer (the draft has {hf.get('num_hidden_layers')})")
    arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    cfg = _draft_config(hf, EAGLE3_ARCHITECTURES.get(arch, arch), names, target)
    _check_width("target_hidden_size", hf.get("target_hidden_size") or cfg.hidden_size, target)
    draft_vocab = hf.get("draft_vocab_size")
    if draft_vocab is None:
        _check_width("hidden_size", cfg.hidden_size, target)  # it will use the target's head
        logger.info("EAGLE3 draft has no draft_vocab_size: using the target's lm_head (full vocabulary)")
    with torch.device("meta"):
        return LlamaForCausalLMEagle3(cfg, target.config.hidden_size, draft_vocab,
                                      _eagle3_aux_layers(hf, target.config.num_layers),
                                      fc_bias=hf.get("bias", False),
                                      norm_before_residual=hf.get("norm_before_residual", False))


def _eagle3_aux_layers(hf: dict, num_layers: int) -> tuple[int, ...]:
    """Before-layer capture indices: `eagle_aux_hidden_state_layer_ids` name layer outputs
    (so id + 1); the default (2, L//2, L-3) already has before-layer semantics."""
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(i + 1 for i in ids) if ids else (2, num_layers // 2, num_layers - 3)
    if any(not 0 <= i <= num_layers for i in layers):
        raise ValueError(f"EAGLE3 aux hidden-state layers {layers} (before-layer indices) do not fit "
                         f"a target with {num_layers} layers")
    return layers


def _build_mtp(hf: dict, names: list[str], target: LlamaForCausalLM) -> DraftModel:
    trunk = LlamaConfig.from_hf(hf)
    if (trunk.vocab_size, trunk.hidden_size) != (target.config.vocab_size, target.config.hidden_size):
        raise ValueError("the MTP layers' checkpoint is not the target's (vocab_size or hidden_size differ)")
    cfg = dataclasses.replace(trunk, num_layers=1, num_nextn_predict_layers=0, tie_word_embeddings=False)
    mimo = trunk.architecture == MIMO or any(n.startswith("model.mtp_layers.") for n in names)
    if mimo:
        count = len({m.group(1) for n in names if (m := re.match(r"model\.mtp_layers\.(\d+)\.", n))})
    else:
        count = trunk.num_nextn_predict_layers
    if count > 1:
        logger.info("the checkpoint has %d MTP layers: using layer 0, the others are unused", count)
    with torch.device("meta"):
        return MiMoMTP(cfg) if mimo else DeepseekNextN(cfg, layer_index=trunk.num_layers)


def _read(path: Path, names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Only the tensors named (an MTP draft reads a few of the trunk's many)."""
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                if name in names:
                    yield name, sf.get_tensor(name)


def _load_weights(draft: DraftModel, path: Path, names: list[str]) -> None:
    mapped = {n: draft.param_name(n) for n in names if not n.endswith("rotary_emb.inv_freq")}
    wanted = {n: ours for n, ours in mapped.items() if ours is not None}
    params = loadable_tensors(draft)
    loaded, unexpected = set(), []
    for name, tensor in _read(path, set(wanted)):
        keys = load_tensor(params, draft.config, wanted[name], tensor)
        if not keys:
            unexpected.append(name)
        loaded.update(keys)
    if unexpected:
        raise ValueError(f"draft checkpoint {path} has {len(unexpected)} unexpected tensors for "
                         f"{type(draft).__name__}: {sorted(unexpected)[:5]}")
    try:
        check_complete(draft, draft.config, loaded, display=draft.checkpoint_name)
    except ValueError as e:
        raise ValueError(f"draft checkpoint {path}: {e}") from None


def _check_token_map(path: Path, ids: torch.Tensor, vocab_size: int, what: str) -> None:
    """Draft index -> target id must be unique ids within the target's vocabulary."""
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{path}: the {what} maps to token ids outside the target's vocabulary "
                         f"[0, {vocab_size})")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"{path}: the {what} maps two draft tokens to the same target token")
