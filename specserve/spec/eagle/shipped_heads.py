"""Draft heads shipped with specserve for catalogue models, trained by `specserve train-draft`.

`--speculative-algorithm EAGLE3` without `--speculative-draft-model-path` on a target that
is one of these models drafts with its shipped head. A target is recognised by the marker
its catalogue conversion wrote (`models/catalogue.py`): the default model, started with no
--model or as `smollm2-135m`, matches; other weights never pick up a head trained for
another model. This file knows where heads live, not how they are loaded.
"""
from __future__ import annotations

import json
from pathlib import Path

from specserve.models.gguf import MARKER

HEADS_DIR = Path(__file__).resolve().parents[2] / "heads"  # specserve/heads/
# (catalogue name, algorithm) -> directory under HEADS_DIR, in the loader's layout
SHIPPED = {("smollm2-135m", "EAGLE3"): "smollm2-135m-eagle3"}


def has_shipped_head(model_path: str, algorithm: str) -> bool:
    """Whether --model `model_path` (a catalogue name) comes with a head for `algorithm`."""
    return (model_path, algorithm) in SHIPPED


def shipped_head(model_dir: Path, algorithm: str) -> Path | None:
    """The head shipped for the catalogue model converted into `model_dir`, if any."""
    try:
        name = json.loads((Path(model_dir) / MARKER).read_text()).get("catalogue")
    except (OSError, ValueError):
        return None
    head = SHIPPED.get((name, algorithm))
    return HEADS_DIR / head if head is not None and (HEADS_DIR / head / "config.json").is_file() else None
