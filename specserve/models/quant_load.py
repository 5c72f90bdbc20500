"""fp8 checkpoint tensors into quantized layers: what lands where (`checkpoint.py` copies).

A quantized `Linear` (layers.py `quantize_storage`) holds `weight` fp8 [N, K] and
`weight_scale` float32 [N, groups] (an int4 one also `weight_zeros`, filled from an AWQ or
GPTQ layer converted whole: `int4_pieces`). Three kinds of tensor fill an fp8 layer:
- an fp8 weight of an fp8 checkpoint: copied as it is (`checkpoint.load_tensor`);
- its scale, `*.weight_scale` (per tensor: one number; per channel: [N] or [N, 1]) or
  `*.weight_scale_inv` (DeepSeek/Qwen3 blocks: [ceil(N / bn), ceil(K / bk)], multiplied in
  despite the name): expanded to one row per weight row (core/quant.py
  `expand_block_scale`), then cut to this rank's rows and groups like the weight;
- a float weight: quantized per row as it lands (`quantize_fp8` over the whole tensor,
  before the rank's slice is cut, so every tensor-parallel size holds the same values).
Static activation scales (`input_scale`, and the KV cache's `k_scale`/`v_scale`) are not
used: activations are scaled per token as they come (quant_linear.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from specserve.core import quant
from specserve.models.tp_shard import shard, shard_quant, shard_scale

if TYPE_CHECKING:
    from specserve.models.llama import LlamaConfig

_SCALES = (".weight_scale", ".weight_scale_inv")
_IGNORED = (".input_scale", ".k_scale", ".v_scale", ".activation_scale")


class Piece(NamedTuple):
    """A slice of a checkpoint tensor bound for rows offset.. of parameter `target`."""

    target: str
    offset: int
    tensor: torch.Tensor  # this rank's slice
    full: tuple[int, ...]  # the whole tensor's shape, for messages


def ignored(name: str) -> bool:
    """Whether `name` is a static activation scale, which serving does not use."""
    return name.endswith(_IGNORED)


def is_scale(name: str) -> bool:
    return name.endswith(_SCALES)


def scale_piece(params: dict[str, torch.Tensor], cfg: LlamaConfig, name: str, target: str, offset: int,
                tensor: torch.Tensor) -> Piece:
    """The piece of an fp8 checkpoint's scale tensor `name` (see the module docstring)."""
    key = target.removesuffix("_inv")
    if key not in params:
        raise ValueError(f"tensor {name} scales a layer that is not quantized here")
    param = params[key]
    weight = name.rsplit(".", 1)[0] + ".weight"
    block_rows, block_cols = cfg.weight_block or (1, 0)
    rows = _full_rows(weight, cfg, param.shape[0])
    per_row = quant.expand_block_scale(tensor, rows, block_rows)
    k = _full_cols(weight, cfg)
    local = shard_scale(weight, per_row, block_cols or k, k, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    if local.shape[1] != param.shape[1]:
        raise ValueError(f"tensor {name} has {local.shape[1]} scale groups a row here, expected {param.shape[1]}")
    return Piece(key, offset, local, tuple(tensor.shape))


def quantize_pieces(params: dict[str, torch.Tensor], cfg: LlamaConfig, name: str, target: str, offset: int,
                    tensor: torch.Tensor) -> list[Piece]:
    """A float weight quantized into an fp8 layer: its data and its scales (module docstring)."""
    key = target.removesuffix(".weight") + ".weight_scale"
    groups = params[key].shape[1]
    group = None if groups == 1 else (cfg.weight_block or (0, 128))[1]
    data, scale = quant.quantize_fp8(tensor, group)
    k = tensor.shape[1]
    heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    return [Piece(target, offset, shard(name, data, *heads), tuple(data.shape)),
            Piece(key, offset, shard_scale(name, scale, group or k, k, *heads), tuple(scale.shape))]


def int4_pieces(params: dict[str, torch.Tensor], cfg: LlamaConfig, name: str, target: str, offset: int,
                qw: quant.QuantWeight) -> list[Piece]:
    """An AWQ/GPTQ layer converted to int4 (core/quant.py): this rank's slices of its data,
    scales and zero points (`tp_shard.py`; a row-parallel layer's columns on group edges)."""
    base = target.removesuffix(".weight")
    if target not in params or params[target].dtype != torch.uint8:
        raise ValueError(f"{name}: a 4-bit layer where the model holds no 4-bit weight")
    assert qw.zeros is not None
    local = shard_quant(name, qw, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert local.zeros is not None
    return [Piece(target, offset, local.data, tuple(qw.data.shape)),
            Piece(f"{base}.weight_scale", offset, local.scale, tuple(qw.scale.shape)),
            Piece(f"{base}.weight_zeros", offset, local.zeros, tuple(qw.zeros.shape))]


def _full_rows(weight: str, cfg: LlamaConfig, rows: int) -> int:
    """Rows of the whole checkpoint weight `weight`: those that tensor parallelism splits
    are known from the config; any other keeps all its rows here (`rows`)."""
    if ".q_proj." in weight:
        return cfg.num_heads * cfg.head_dim
    if ".k_proj." in weight or ".v_proj." in weight:
        return cfg.num_kv_heads * cfg.head_dim
    if ".gate_proj." in weight or ".up_proj." in weight:
        return cfg.intermediate_size
    return rows


def _full_cols(weight: str, cfg: LlamaConfig) -> int:
    """Columns of the whole weight where tensor parallelism splits them (o_proj, down_proj);
    0 elsewhere (never read: their columns are not split)."""
    if weight.endswith(".o_proj.weight"):
        return cfg.num_heads * cfg.head_dim
    if weight.endswith(".down_proj.weight"):
        return cfg.intermediate_size
    return 0
