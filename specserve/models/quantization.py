"""Which weights a model quantizes, and how it reports them.

`resolve` reads `--quantization` (or `--speculative-draft-model-quantization`) and the
checkpoint's own `quantization_config`: a checkpoint stored in fp8, AWQ or GPTQ is served
so whether or not the flag says so, and a flag that contradicts it is an error, as in vLLM.
`prepare` turns every `Linear` of a model (attention and MLP projections, EAGLE's `fc`,
MTP's projections) into quantized storage before its checkpoint loads (fp8, or int4 for
AWQ/GPTQ, whose layers `checkpoint_tensors` converts); the embeddings and the LM head stay
in the model's dtype, as vLLM and SGLang keep them. `quantize_now` does the same to a model
whose float weights are already in place (random weights for benchmarks). `weight_bytes`
counts what a model's weights occupy and read per token.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from specserve.core import quant
from specserve.core.config import ConfigError
from specserve.models.layers import Linear
from specserve.models.quant_int4 import Int4Config, convert_int4, int4_config, quantize_int4

logger = logging.getLogger("specserve")

UNQUANT = "unquant"  # SGLang's value of --speculative-draft-model-quantization for "keep it in float"


@dataclass(frozen=True)
class WeightQuant:
    method: str  # "fp8", "awq" or "gptq" (these two held as int4: core/quant.py)
    block: tuple[int, int] | None = None  # an fp8 checkpoint's scale blocks (rows, columns)
    from_checkpoint: bool = False  # the checkpoint is stored quantized
    int4: Int4Config | None = None  # an AWQ/GPTQ checkpoint's layout; random int4 weights: None

    @property
    def storage(self) -> tuple[int | None, str]:
        """(input columns a scale covers, None for a whole row; core/quant.py method) of its layers."""
        if self.method == "fp8":
            return (self.block[1] if self.block else None), "fp8"
        group = self.int4.group if self.int4 is not None else RANDOM_INT4_GROUP
        return (None if group == -1 else group), quant.INT4


RANDOM_INT4_GROUP = 128  # random (dummy) AWQ/GPTQ weights: the tools' usual group


def resolve(flag: str | None, hf_config: dict, random_weights: bool = False) -> WeightQuant | None:
    """The quantization a model loads with, from the flag and its config.json (random
    weights take the flag's format as it is)."""
    qc = hf_config.get("quantization_config") or {}
    stored = qc.get("quant_method")
    if flag in ("gguf", "none"):  # a GGUF's blocks or float weights: models/gguf_serve.py decides
        if stored is not None:
            raise ValueError(f"the checkpoint is stored in {stored}; --quantization {flag} does not apply to it")
        return None
    if stored is None:
        if flag in ("awq", "gptq") and not random_weights:
            raise ValueError(f"--quantization {flag} needs a checkpoint quantized by {flag.upper()} "
                             f"(config.json quantization_config.quant_method {flag!r}); use fp8 to quantize at load")
        return None if flag in (None, UNQUANT) else WeightQuant(flag)
    if stored not in quant.METHODS:
        raise ValueError(f"the checkpoint is quantized with {stored!r}, which is not supported yet "
                         f"(supported: {', '.join(quant.METHODS)})")
    if flag not in (None, stored):
        raise ValueError(f"the checkpoint is stored in {stored}; --quantization {flag} does not apply to it")
    if stored != "fp8":
        return WeightQuant(stored, from_checkpoint=True, int4=int4_config(hf_config))
    block = qc.get("weight_block_size")
    return WeightQuant("fp8", (int(block[0]), int(block[1])) if block else None, True)


def check_device(wq: WeightQuant | None, device: torch.device) -> None:
    """Refuse fp8 weights on a GPU without fp8 (compute capability below 8.9: before Ada and Hopper)."""
    if wq is None or wq.method != "fp8" or device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"--quantization {wq.method}: {name} (compute capability {major}.{minor}) has no fp8; "
                          "fp8 weights need compute capability 8.9 or later (Ada, Hopper)")


def draft_flag(draft_flag: str | None, target: WeightQuant | None) -> str | None:
    """The draft's quantization flag: its own, else the target's (SGLang's default) where the
    draft can take it at load: fp8. A draft of an AWQ/GPTQ target is 4-bit only where its
    own checkpoint is (`resolve` reads that)."""
    if draft_flag is not None:
        return draft_flag
    return "fp8" if target is not None and target.method == "fp8" else None


def prepare(model: nn.Module, wq: WeightQuant | None) -> None:
    """Every `Linear` of `model` to quantized storage, unloaded (before its checkpoint loads)."""
    if wq is None:
        return
    group, method = wq.storage
    for module in model.modules():
        if isinstance(module, Linear):
            module.quantize_storage(group, method)


def quantize_now(model: nn.Module, wq: WeightQuant | None) -> None:
    """Every float `Linear` of `model` quantized in place: fp8 per row, int4 (random AWQ or
    GPTQ weights) asymmetric in groups of RANDOM_INT4_GROUP."""
    if wq is None:
        return
    group, method = wq.storage
    for module in model.modules():
        if isinstance(module, Linear) and module.quantized is None:
            if method == quant.INT4:
                qw = quantize_int4(module.weight, group or module.weight.shape[1])
                parts = [qw.data, qw.scale, qw.zeros]
            else:
                parts = list(quant.quantize_fp8(module.weight))
            module.quantize_storage(group if method == quant.INT4 else None, method)
            with torch.no_grad():
                for dest, src in zip((module.weight, module.weight_scale, module.weight_zeros), parts):
                    assert dest is not None and src is not None
                    dest.copy_(src)


_INT4_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def checkpoint_tensors(weights: Iterable[tuple[str, torch.Tensor]],
                       wq: WeightQuant | None) -> Iterator[tuple[str, torch.Tensor | quant.QuantWeight]]:
    """A checkpoint's tensors as the model loads them: an AWQ/GPTQ layer's parts (`qweight`,
    `qzeros`, `scales`, `g_idx`) gathered and converted into one int4 weight named
    `<layer>.weight` (models/quant_int4.py), after every other tensor."""
    if wq is None or wq.int4 is None:
        yield from weights
        return
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part in _INT4_PARTS:
            layers.setdefault(prefix, {})[part] = tensor
        else:
            yield name, tensor
    for prefix, parts in layers.items():
        try:
            yield f"{prefix}.weight", convert_int4(parts, wq.int4)
        except (KeyError, ValueError) as e:
            raise ValueError(f"{prefix}: {e}") from None


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes a token reads, weights it reads): every parameter but the input embedding's
    table, of which a token reads one row (unless tied to the LM head); fp8 scales add
    bytes, not weights."""
    embeds = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    heads = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    blocks = getattr(model, "head_blocks", None)  # a GGUF's head, read in place of the float one
    if blocks is not None:
        embeds |= heads
        heads = set()
    scales = {id(t) for m in model.modules() if isinstance(m, Linear) for t in (m.weight_scale, m.weight_zeros)}
    total = count = 0
    for p in model.parameters():
        if id(p) in embeds and id(p) not in heads:
            continue
        total += p.numel() * p.element_size()
        count += 0 if id(p) in scales else p.numel() * (2 if p.dtype == torch.uint8 else 1)  # int4: two a byte
    if blocks is not None:
        total += sum(t.numel() * t.element_size() for t in (blocks.data, blocks.scale, blocks.zeros) if t is not None)
        count += blocks.shape[0] * blocks.shape[1]
    return total, count


def info(model: nn.Module) -> dict:
    """/get_server_info's account of a model's weights: method (None: float), where the
    quantized values came from, bytes a token reads and bytes a weight (scales counted)."""
    wq = getattr(model, "weight_quant", None)
    total, count = weight_bytes(model)
    return {"method": wq.method if wq else None, "from_checkpoint": bool(wq and wq.from_checkpoint),
            "block": list(wq.block) if wq and wq.block else None, "bytes_read_per_token": total,
            "bytes_per_weight": round(total / max(count, 1), 4)}


def describe(model: nn.Module, wq: WeightQuant | None) -> str:
    """'fp8, 1.02 bytes a weight' (or 'none, ...') for the start-up log."""
    total, count = weight_bytes(model)
    return f"{wq.method if wq else 'none'}, {total / max(count, 1):.2f} bytes a weight"
