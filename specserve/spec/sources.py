"""Where a draft comes from: --speculative-draft-model-path resolved to a local directory.

Any model source the target accepts (an HF directory, a .gguf file, a catalogue name, a hub
id), fetched or converted once. Start-up resolves it before the target (preflight.py), so a
wrong path fails before anything large is fetched. Imports lazily: parsing a command line
loads these modules and must not import torch.
"""
from __future__ import annotations

from pathlib import Path

from specserve.core.config import SpecConfig


def explicit_draft_dir(spec: SpecConfig) -> Path | None:
    """The local directory of --speculative-draft-model-path; None without one, or for an
    algorithm that takes no draft model. ValueError for a bad path."""
    from specserve.spec import registry

    if spec.draft_model_path is None or spec.algorithm is None or registry.get(spec.algorithm).draft_model == "none":
        return None
    from specserve.models.source import resolve_model_dir

    return resolve_model_dir(spec.draft_model_path, spec.draft_model_revision, spec.draft_load_format or "auto")
