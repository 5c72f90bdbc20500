"""Checkpoint tensors into a Llama-family model: HF names to our fused parameters.

q/k/v land in row blocks of `qkv_proj` and gate/up in `gate_up_proj`; under tensor
parallelism each tensor is first cut to this rank's slice (`tp_shard.py`), and the row
blocks are this rank's sizes. `check_complete` names, in HF terms, what a checkpoint
lacks. Shared by the trunk (`llama.py`) and the draft loaders. Quantized layers' weights
and scales go through `quant_load.py`.
"""
from __future__ import annotations

from collections.abc import Callable, Container
from typing import TYPE_CHECKING

import torch
from torch import nn

from specserve.core import quant
from specserve.models import quant_load
from specserve.models.tp_shard import shard

if TYPE_CHECKING:
    from specserve.models.llama import LlamaConfig

_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}


def _local_sizes(cfg: LlamaConfig) -> tuple[int, int, int]:
    """Rows of q, of k (and v) and of gate (and up) in this rank's fused projections."""
    return (cfg.heads_per_rank * cfg.head_dim, cfg.kv_heads_per_rank * cfg.head_dim,
            cfg.intermediate_per_rank)


def fused_target(name: str, cfg: LlamaConfig) -> tuple[str, int]:
    """Map an HF tensor name to (our parameter name, first row it fills)."""
    q, kv, inter = _local_sizes(cfg)
    for proj, idx in _QKV.items():
        if f".self_attn.{proj}." in name:
            return name.replace(proj, "qkv_proj"), [0, q, q + kv][idx]
    if ".mlp.gate_proj." in name:
        return name.replace("gate_proj", "gate_up_proj"), 0
    if ".mlp.up_proj." in name:
        return name.replace("up_proj", "gate_up_proj"), inter
    return name, 0


def _hf_name(key: str, cfg: LlamaConfig) -> str:
    """Inverse of `fused_target` for messages: 'x.qkv_proj.weight@64' -> 'x.k_proj.weight'."""
    name, offset = key.rsplit("@", 1)
    q, kv, _ = _local_sizes(cfg)
    if "qkv_proj" in name:
        return name.replace("qkv_proj", {0: "q_proj", q: "k_proj", q + kv: "v_proj"}[int(offset)])
    if "gate_up_proj" in name:
        return name.replace("gate_up_proj", "up_proj" if int(offset) else "gate_proj")
    return name


def loadable_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name: what a checkpoint may fill."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def load_tensor(params: dict[str, torch.Tensor], cfg: LlamaConfig, name: str,
                tensor: torch.Tensor | quant.QuantWeight) -> list[str]:
    """Copy one HF-named tensor (in our module paths) into `params`; q/k/v and gate/up land
    in row blocks of the fused projections; under tensor parallelism only this rank's slice
    (`tp_shard.py`). Returns the slice keys 'param@first_row' it filled (a float weight
    quantized on the way fills its fp8 weight and its scales: `quant_load.py`), none when
    no parameter has that name. A shape that does not fit raises ValueError."""
    if quant_load.ignored(name):
        return [name]
    target, offset = fused_target(name, cfg)
    if isinstance(tensor, quant.QuantWeight):  # an AWQ/GPTQ layer, converted (models/quantization.py)
        pieces = quant_load.int4_pieces(params, cfg, name, target, offset, tensor)
    elif quant_load.is_scale(name):
        pieces = [quant_load.scale_piece(params, cfg, name, target, offset, tensor)]
    elif target not in params:
        return []
    elif params[target].dtype == quant.FP8 and tensor.dtype != quant.FP8:
        pieces = quant_load.quantize_pieces(params, cfg, name, target, offset, tensor)
    elif tensor.dtype == quant.FP8 and params[target].dtype != quant.FP8:
        raise ValueError(f"tensor {name} is fp8 but its layer is not quantized here")
    else:
        local = shard(name, tensor, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        pieces = [quant_load.Piece(target, offset, local, tuple(tensor.shape))]
    return [_copy_rows(params[p.target], name, p) for p in pieces]


def _copy_rows(param: torch.Tensor, name: str, piece: quant_load.Piece) -> str:
    """Copy a piece of the checkpoint tensor `name` into its rows of `param`; returns the slice key."""
    offset, tensor, full = piece.offset, piece.tensor, piece.full
    rows = tensor.shape[0] if tensor.dim() else 1
    dest = param[offset:offset + rows] if param.dim() else param
    if dest.shape != tensor.shape:
        shards = f" (this rank's slice of {full})" if full != tuple(tensor.shape) else ""
        raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}{shards}, expected {tuple(dest.shape)}")
    with torch.no_grad():
        dest.copy_(tensor.to(param.dtype))
    return f"{piece.target}@{offset}"


def check_complete(model: nn.Module, cfg: LlamaConfig, loaded: set[str], skip: Container[str] = frozenset(),
                   display: Callable[[str], str] = lambda name: name) -> None:
    """Raise ValueError naming the tensors (HF names, through `display`) that `loaded`
    (slice keys from `load_tensor`) lacks; parameters in `skip` are not expected."""
    q, kv, inter = _local_sizes(cfg)
    expected = set()
    for name in loadable_tensors(model):
        if name in skip:
            continue
        if "qkv_proj" in name:
            expected |= {f"{name}@0", f"{name}@{q}", f"{name}@{q + kv}"}
        elif "gate_up_proj" in name:
            expected |= {f"{name}@0", f"{name}@{inter}"}
        else:
            expected.add(f"{name}@0")
    missing = sorted(display(_hf_name(key, cfg)) for key in expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
