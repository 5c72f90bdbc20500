"""Convert a `.gguf` file into a Hugging Face-layout model directory.

This file owns the GGUF -> HF translation: llama.cpp's metadata keys become a transformers
`config.json`, its tensor names become HF names (dequantized to float32, Q/K row permutation
undone for the `llama` arch), and its byte-level BPE vocabulary becomes a `tokenizer.json`
plus `tokenizer_config.json` / `generation_config.json`. The result loads with
`transformers.AutoModelForCausalLM.from_pretrained(out_dir)` as well as with our own loader.

Its quantized linear weights are also kept as they are, repacked (models/gguf_blocks.py,
`gguf/blocks.safetensors`), for the CPU to serve without dequantizing them.

It knows nothing about where the file came from (catalogue, user path) or where converted
directories are cached: callers pass `out_dir`. A directory is complete iff `is_converted()`
says so: its marker, written last inside a temp dir that is then renamed, names this
converter's FORMAT (a directory from an older converter is converted again).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from tqdm import tqdm

from specserve.models import gguf_blocks
from specserve.models.gguf_tokenizer import build_tokenizer, generation_config, tokenizer_config

MARKER = "specserve-converted.json"
FORMAT = 3  # 2: with gguf/blocks.safetensors; 3: its q/k/v and gate/up fused

# GGUF general.architecture -> (HF architectures[0], model_type)
_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {  # blk.{i}.<key> -> model.layers.{i}.<value>
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    **{f"attn_{g}.{p}": f"self_attn.{h}_proj.{p}"
       for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")) for p in ("weight", "bias")},
}
_ROPE_FREQS = "rope_freqs.weight"  # llama3 rope factors: folded into config.rope_scaling


def is_converted(path: Path) -> bool:
    """True iff `path` is a complete conversion by this converter (its marker is the last
    file written)."""
    marker = Path(path) / MARKER
    return marker.is_file() and json.loads(marker.read_text()).get("format") == FORMAT


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata as plain Python values (strings, numbers, lists)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not field.types:
            continue
        value = field.contents()
        if field.types[0] == GGUFValueType.ARRAY and not isinstance(value, list):
            value = list(value)
        meta[key] = value
    return meta


def convert_gguf(gguf_path: Path, out_dir: Path, marker: dict[str, Any] | None = None) -> None:
    """Write `out_dir` (config, float32 safetensors, tokenizer files) from `gguf_path`.

    Atomic: everything goes into a hidden temp dir next to `out_dir`, the marker (with
    `marker` merged in) is written last, then the temp dir is renamed onto `out_dir`
    (an existing `out_dir` is replaced). On any failure the temp dir is removed.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        reader = GGUFReader(gguf_path)
        meta = read_metadata(reader)
        config = hf_config(meta, reader)
        _write_json(tmp / "config.json", config)
        _write_weights(tmp / "model.safetensors", reader, config)
        _write_blocks(tmp / gguf_blocks.BLOCKS_FILE, reader, config)
        build_tokenizer(meta).save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(meta, config["max_position_embeddings"]))
        _write_json(tmp / "generation_config.json", generation_config(meta))
        _write_json(tmp / MARKER, {"source": gguf_path.name, "format": FORMAT, **(marker or {})})
        _replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def hf_config(meta: dict[str, Any], reader: GGUFReader) -> dict[str, Any]:
    """The transformers `config.json` dict for this GGUF (llama / qwen2 / qwen3 only)."""
    arch = meta["general.architecture"]
    if arch not in _ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHS)})")

    def get(k: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{k}", default)

    tensors = {t.name: t for t in reader.tensors}
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    kv_heads = _single(get("attention.head_count_kv", heads), "attention.head_count_kv")
    head_dim = int(get("attention.key_length", hidden // heads))
    if get("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"partial rotary embeddings (rope.dimension_count != {head_dim}) are not supported")
    theta = _f32(get("rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [_ARCHS[arch][0]], "model_type": _ARCHS[arch][1],
        "attention_bias": "blk.0.attn_q.bias" in tensors, "attention_dropout": 0.0,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "head_dim": head_dim, "hidden_act": "silu", "hidden_size": hidden,
        "initializer_range": 0.02, "intermediate_size": int(get("feed_forward_length")),
        "max_position_embeddings": int(get("context_length")), "mlp_bias": False,
        "num_attention_heads": heads, "num_hidden_layers": int(get("block_count")),
        "num_key_value_heads": kv_heads, "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta, "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32", "use_cache": True,
        # rows of the embedding: GGUF shapes are ggml order [in, out]
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
    }
    freqs = tensors.get(_ROPE_FREQS)
    factors = None if freqs is None else np.asarray(_dequant(freqs), dtype=np.float64).reshape(-1)
    scaling = rope_scaling(meta, arch, factors, head_dim, theta)
    if scaling is not None:
        config["rope_scaling"] = scaling
    if arch == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=config["num_hidden_layers"])
    return dict(sorted(config.items()))


def rope_scaling(meta: dict[str, Any], arch: str, factors: np.ndarray | None,
                 head_dim: int, theta: float) -> dict[str, Any] | None:
    """HF `rope_scaling` from GGUF: linear/yarn metadata, or llama3 factors in `rope_freqs`."""
    if factors is not None:
        return _llama3_from_factors(factors, head_dim, theta)
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "none" or factor in (None, 0.0, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn":
        orig = meta.get(f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": _f32(factor), "original_max_position_embeddings": orig}
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (supported: linear, yarn, llama3)")


def _llama3_from_factors(rf: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """Recover llama3 rope parameters from llama.cpp's per-frequency divisors.

    llama.cpp stores rf[i] = 1 / ((1 - s) / factor + s) with s = (orig / wavelen - low) /
    (high - low) in the smooth band, 1 above it, `factor` below it. s is linear in
    1/wavelen, but (orig, low, high) are only known up to a common scale, so we fix
    low_freq_factor = 1 (every Llama 3.x release) and fit the other two, then verify.
    """
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(rf.max())
    band = (rf > 1 + 1e-6) & (rf < factor * (1 - 1e-6))
    if factor <= 1.0 or band.sum() < 2:
        raise ValueError("rope_freqs tensor does not describe llama3 rope scaling we can recover")
    s = (1.0 / rf[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(inv_freq[band] / (2 * math.pi), s, 1)  # s = a / wavelen + b
    high, orig = 1.0 - 1.0 / intercept, round(-slope / intercept)
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
              "high_freq_factor": float(round(high, 4)), "original_max_position_embeddings": orig}
    wavelen = 2 * math.pi / inv_freq
    smooth = (orig / wavelen - 1.0) / (params["high_freq_factor"] - 1.0)
    expect = np.where(wavelen < orig / params["high_freq_factor"], 1.0,
                      np.where(wavelen > orig, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    if not np.allclose(expect, rf, rtol=1e-4):
        raise ValueError("rope_freqs tensor does not match llama3 rope scaling; cannot convert")
    return params


def _write_weights(path: Path, reader: GGUFReader, config: dict[str, Any]) -> None:
    """Dequantize every tensor to float32 [out, in] and stream it into one safetensors file."""
    # GGUF shapes are ggml order (innermost first): reversed, they are HF [out, in].
    plan = [(t, _hf_name(t.name), tuple(int(d) for d in reversed(t.shape)))
            for t in reader.tensors if t.name != _ROPE_FREQS]
    permuted = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}

    def arrays() -> Iterator[np.ndarray]:
        for t, name, shape in tqdm(plan, desc="Converting GGUF tensors", unit="tensor"):
            w = _dequant(t).reshape(shape)
            proj = name.split(".")[-2]
            if config["model_type"] == "llama" and proj in permuted:  # qwen2/3 are not permuted
                w = unpermute_qk(w, permuted[proj])
            yield w

    write_safetensors(path, [(name, shape) for _, name, shape in plan], arrays())


def _write_blocks(path: Path, reader: GGUFReader, config: dict[str, Any]) -> None:
    """The quantized 2-D weights in their blocks, repacked, rows in HF order; q/k/v and
    gate/up stacked into our fused projections where they share a form."""
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    weights = {}
    for t in reader.tensors:
        if len(t.shape) != 2 or not gguf_blocks.repackable(t.tensor_type):
            continue
        name = _hf_name(t.name)
        rows, cols = (int(d) for d in reversed(t.shape))
        r = gguf_blocks.repack(t.data, t.tensor_type, rows, cols)
        proj = name.split(".")[-2]
        if config["model_type"] == "llama" and proj in heads:
            r = gguf_blocks.permute_rows(r, unpermute_qk(np.arange(rows), heads[proj]))
        weights[name] = r
    gguf_blocks.save(path, gguf_blocks.fuse(weights))


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation (HF [out, ...] layout in and out).

    llama.cpp: w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2), i.e. inside each
    head it interleaves the two rotary halves; we reshape to the permuted view and swap back.
    """
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def write_safetensors(path: Path, specs: list[tuple[str, tuple[int, ...]]],
                      arrays: Iterator[np.ndarray]) -> None:
    """Stream float32 tensors into a safetensors file, one tensor in memory at a time."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in specs:
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(len(blob) + 8) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for (name, shape), arr in zip(specs, arrays, strict=True):
            arr = np.ascontiguousarray(arr, dtype="<f4")
            assert arr.shape == shape, (name, arr.shape, shape)
            f.write(arr.data.cast("B"))  # arr is C-contiguous: its buffer, as bytes


def _dequant(t: Any) -> np.ndarray:
    try:
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    except NotImplementedError as e:
        raise ValueError(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which cannot be "
                         f"dequantized by the installed gguf package ({e})") from None


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent we know")


def _single(value: Any, key: str) -> int:
    values = set(value) if isinstance(value, list) else {value}
    if len(values) != 1:
        raise ValueError(f"per-layer {key} {sorted(values)} is not supported")
    return int(values.pop())


def _f32(x: float) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(x)))


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Rename tmp onto out_dir; an existing out_dir is moved aside first, then deleted."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
        out_dir.rename(old)
    tmp.rename(out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_stale_temps(out_dir: Path) -> None:
    """Delete temp dirs left by conversions of `out_dir` whose process is gone (kill -9)."""
    for p in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        pid = p.name.rsplit("-", 2)[-2]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
