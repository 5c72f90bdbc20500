"""A GGUF model served in its own blocks on the CPU (`--quantization gguf`).

`resolve` decides: a converted GGUF directory that carries its blocks (models/gguf_blocks.py)
is served quantized on the CPU unless `--quantization none` asks for float weights (or the
caller cannot take quantized layers: `--enable-deterministic-inference`; tensor
parallelism, whose shards the blocks are not cut into yet); `--quantization gguf` on
anything else is an error, as is asking for it on a GPU (its kernels there do not exist
yet). `apply` runs after the float weights have loaded: each `Linear` whose rows
are all repacked blocks (q, k and v of one method and group for the fused qkv; gate and
up for gate_up) takes them as its storage and drops its float weight; the LM head's
blocks become the model's `head_blocks`, read by `compute_logits` (the float head stays
for drafts that share it). The float embedding table, and a head tied to it, become the
checkpoint file's mapped pages. Layers whose GGUF type is not repacked stay float. When every
layer holds blocks, the model's few-token forwards run in one C call (models/cpu_stack.py).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from specserve.core import parallel, quant
from specserve.core.config import ConfigError
from specserve.kernels import cpu_quant
from specserve.models import gguf_blocks
from specserve.models.checkpoint import fused_target
from specserve.models.cpu_stack import CpuStack
from specserve.models.layers import Linear

if TYPE_CHECKING:
    from specserve.models.llama import LlamaForCausalLM

logger = logging.getLogger("specserve")

GGUF, NONE = "gguf", "none"  # --quantization values this file owns


def resolve(flag: str | None, model_dir: Path, device: torch.device, allowed: bool = True) -> bool:
    """Whether `model_dir` is served in its GGUF blocks. `allowed` False: the caller takes
    float layers only (an explicit `--quantization gguf` is then an error)."""
    has_blocks = (Path(model_dir) / gguf_blocks.BLOCKS_FILE).is_file()
    if flag == GGUF:
        if not has_blocks:
            raise ConfigError(f"--quantization gguf needs a GGUF model; {model_dir} was not converted from one")
        if device.type != "cpu":
            raise ConfigError("--quantization gguf runs on the CPU only for now; on a GPU the GGUF is "
                              "served dequantized (leave --quantization unset)")
        if not allowed:
            raise ConfigError("--quantization gguf with --enable-deterministic-inference is not supported yet")
        if parallel.tp_size() > 1:
            raise ConfigError("--quantization gguf with --tp-size > 1 is not supported yet")
    if not (flag in (None, GGUF) and has_blocks and device.type == "cpu" and allowed and parallel.tp_size() == 1):
        return False
    if not cpu_quant.available():  # said in the log by cpu_quant
        if flag == GGUF:
            raise ConfigError("--quantization gguf: the quantized CPU kernels could not be built (see the log)")
        return False
    return True


def apply(model: LlamaForCausalLM, model_dir: Path) -> int:
    """Swap the repacked blocks of `model_dir` into `model` (loaded, in its CPU layout);
    returns how many layers now hold blocks."""
    path = Path(model_dir) / gguf_blocks.BLOCKS_FILE
    methods = gguf_blocks.methods(path)
    cfg = model.config
    pieces: dict[str, list[tuple[int, str]]] = {}  # our weight name -> [(first row, HF name)]
    for name in methods:
        target, offset = fused_target(name, cfg)
        pieces.setdefault(target, []).append((offset, name))
    served = 0
    with safe_open(str(path), framework="pt") as f:
        for module_name, module in model.named_modules():
            parts = sorted(pieces.get(f"{module_name}.weight", []))
            if isinstance(module, Linear) and parts:
                qw = _joined(f, [name for _, name in parts], methods)
                if qw is not None and qw.shape == _float_shape(module):
                    _hold(module, qw)
                    served += 1
        head = "lm_head.weight" if "lm_head.weight" in methods else "model.embed_tokens.weight"
        if head in methods and (head == "lm_head.weight" or cfg.tie_word_embeddings):
            model.head_blocks = _joined(f, [head], methods)
    _map_embedding(model, Path(model_dir))
    model.cpu_stack = CpuStack.build(model)
    return served


EMBEDDING = "model.embed_tokens.weight"


def _map_embedding(model: LlamaForCausalLM, model_dir: Path) -> None:
    """The float embedding table (and the head tied to it) as the converted checkpoint's
    pages, as safetensors maps them, where its dtype and shape are the model's: shared by
    every process serving the model, like the blocks, instead of a copy in each."""
    table = model.model.embed_tokens.weight
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            if EMBEDDING not in f.keys():
                continue
            mapped = f.get_tensor(EMBEDDING)
        if mapped.dtype != table.dtype or mapped.shape != table.shape:
            return
        param = nn.Parameter(mapped, requires_grad=False)
        model.model.embed_tokens.weight = param
        if model.lm_head.weight is table:
            model.lm_head.weight = param
        return


def _joined(f, names: list[str], methods: dict[str, tuple[str, int]]) -> quant.QuantWeight | None:
    """One QuantWeight of the weights `names` stacked by rows; None if they differ in form.
    One name (a fused projection as the conversion stores it, or a lone one): its tensors
    as safetensors maps them from the file, not copied, so the pages are shared by every
    process that serves the model and by the OS's page cache."""
    forms = {methods[n] for n in names}
    if len(forms) != 1:
        return None
    (method, group), = forms
    keys = f.keys()
    offsets = [f"{n}.offset" in keys for n in names]
    if any(offsets) and not all(offsets):
        return None

    def cat(part: str) -> torch.Tensor:
        if len(names) == 1:
            return f.get_tensor(f"{names[0]}.{part}")
        return torch.cat([f.get_tensor(f"{n}.{part}") for n in names]).contiguous()

    return quant.QuantWeight(cat("q"), cat("scale"), group, method, cat("offset") if offsets[0] else None)


def _float_shape(module: Linear) -> tuple[int, int]:
    w = module.weight_t.t() if module.weight_t is not None else module.weight
    return int(w.shape[0]), int(w.shape[1])


def _hold(module: Linear, qw: quant.QuantWeight) -> None:
    module.weight = nn.Parameter(qw.data, requires_grad=False)
    module.weight_t = None
    module.weight_scale = nn.Parameter(qw.scale, requires_grad=False)
    module.weight_zeros = None if qw.zeros is None else nn.Parameter(qw.zeros, requires_grad=False)
    module.group, module.method = qw.group, qw.method
