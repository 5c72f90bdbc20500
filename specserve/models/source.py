"""Turn a `--model` string into a local Hugging Face-layout directory.

This file owns the resolution order of DESIGN 1.4: a local HF directory, a `.gguf` file
(converted once into `<cache>/gguf/<sha256[:16]>/`), a catalogue name, a hub id. It knows
nothing about loading weights or tokenizers: every caller gets a directory with
`config.json`, `*.safetensors` and tokenizer files, and takes it from there.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from specserve.models import catalogue
from specserve.models.gguf import convert_gguf, is_converted

# What a hub snapshot needs; skips .bin/.pth/.gguf duplicates of the same weights.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def resolve_model_dir(model_path: str, revision: str | None = None, load_format: str = "auto") -> Path:
    """The local HF-layout directory for `model_path`; raises ValueError with one clear line.

    `load_format` (--load-format) asserts where the weights come from: "gguf" for a .gguf
    file or a catalogue model (all GGUF-sourced), "safetensors" for an HF directory or hub id.
    """
    check_load_format(model_path, load_format)
    path = Path(model_path).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise ValueError(f"{path} is a directory but has no config.json, so it is not a Hugging Face model directory")
    if model_path.endswith(".gguf"):
        if not path.is_file():
            raise ValueError(f"GGUF file {path} does not exist")
        return converted_gguf_dir(path)
    if model_path.lower() in catalogue.CATALOGUE:
        return catalogue.fetch(model_path)
    if path.is_absolute() or model_path.startswith((".", "~")) or model_path.count("/") > 1:
        raise ValueError(f"model path {model_path!r} does not exist")
    return _hub_snapshot(model_path, revision)


def check_load_format(model_path: str, load_format: str) -> None:
    is_gguf = model_path.endswith(".gguf") or model_path.lower() in catalogue.CATALOGUE
    if load_format == "gguf" and not is_gguf:
        raise ValueError(f"--load-format gguf needs a .gguf file or a catalogue model, got {model_path!r}")
    if load_format == "safetensors" and is_gguf:
        raise ValueError(f"--load-format safetensors does not apply to the GGUF model {model_path!r}")


def converted_gguf_dir(gguf_path: Path) -> Path:
    """The HF directory converted from `gguf_path`, keyed by content: converts at most once."""
    out = catalogue.cache_root() / "gguf" / _sha256(gguf_path)[:16]
    if is_converted(out):
        return out
    with catalogue.file_lock(out.parent / f".{out.name}.lock"):
        if not is_converted(out):
            convert_gguf(gguf_path, out, marker={"gguf": str(gguf_path.resolve())})
    return out


def _hub_snapshot(model_id: str, revision: str | None) -> Path:
    names = ", ".join(catalogue.CATALOGUE)
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(
            f"model {model_id!r} was not found: it is not a local directory or .gguf file, not in the "
            f"catalogue ({names}), and downloading it from the Hugging Face hub needs the "
            f"huggingface_hub package (pip install huggingface_hub) and network access") from None
    try:
        return Path(snapshot_download(model_id, revision=revision, allow_patterns=_HUB_PATTERNS))
    except Exception as e:  # network, auth, unknown repo: all one line for the user
        reason = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(
            f"model {model_id!r} was not found locally, is not in the catalogue ({names}), and the "
            f"Hugging Face hub download failed: {type(e).__name__}: {reason}") from e


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()
