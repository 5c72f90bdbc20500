"""EAGLE, EAGLE3 (and MTP, NEXTN): one proposer, a draft head fed the target's own features.

proposer.py drafts; backlog.py, prefill_graphs.py, step_graphs.py, verify_prologue.py and
batch_tree.py are its pipelined, graphed machinery; shipped_heads.py knows the heads that
ship with specserve. The tree drafting itself is shared with STANDALONE (spec/tree/).

This file is the two registry entries. EAGLE takes EAGLE-2 heads or the target's own MTP
layers (NEXTN is its alias); EAGLE3 takes EAGLE-3 heads. At start-up (`resolve`) the draft
is found (the explicit path, else the head shipped for this catalogue model, else the
target's MTP layers), its layout checked against the algorithm, a token map checked, and
with no tree flags the head's own tuned tree (`specserve_default_tree` in its config) is
taken ahead of SGLang's choice by architecture.
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from specserve.core.config import SpecConfig
from specserve.spec.eagle import batch_tree
from specserve.spec.eagle.shipped_heads import has_shipped_head, shipped_head
from specserve.spec.registry import Algorithm, register
from specserve.spec.sources import explicit_draft_dir
from specserve.spec.tree_rules import by_architecture, tree_defaults

if TYPE_CHECKING:
    from specserve.engine.kv_manager import KVManager
    from specserve.models.llama import LlamaConfig
    from specserve.runner.model_runner import ModelRunner
    from specserve.spec.proposer import Proposer

logger = logging.getLogger("specserve")
# draft checkpoint layouts (models/draft_loader.py) each algorithm loads
LAYOUTS = {"EAGLE": ("eagle2", "mtp"), "EAGLE3": ("eagle3",)}
_LAYOUT_NAMES = {"eagle2": "an EAGLE-2 head", "eagle3": "an EAGLE-3 head", "mtp": "a model with MTP layers"}


def make_proposer(spec: SpecConfig, runner: ModelRunner, kv: KVManager, max_running: int) -> Proposer:
    from specserve.spec.eagle.proposer import EagleProposer

    return EagleProposer(spec, runner, kv, max_running)


def defaults(spec: SpecConfig, architecture: str | None) -> SpecConfig:
    return tree_defaults(spec, architecture, by_architecture)


def resolve(spec: SpecConfig, model_dir: Path, target: LlamaConfig) -> SpecConfig:
    """The draft's directory and layout, the token map, the head's own tree (module docstring)."""
    draft = Path(spec.draft_dir) if spec.draft_dir else _find_draft(spec, model_dir)
    check_layout(spec.name, draft)
    token_map = spec.token_map if LAYOUTS[spec.name] != ("eagle3",) else None  # EAGLE-3: its own d2t
    if token_map is not None:
        from specserve.models.token_map import load_token_map

        load_token_map(token_map, target.vocab_size)
    return head_default_tree(replace(spec, draft_dir=str(draft), token_map=token_map))


def _find_draft(spec: SpecConfig, model_dir: Path) -> Path:
    explicit = explicit_draft_dir(spec)
    if explicit is not None:
        return explicit
    head = shipped_head(model_dir, spec.name)
    if head is not None:
        return head
    from specserve.models.mtp import has_mtp_layers

    if not has_mtp_layers(model_dir):
        raise ValueError(f"--speculative-algorithm {spec.algorithm} needs --speculative-draft-model-path: "
                         f"the target model has no MTP layers to draft with")
    return model_dir


def check_layout(algorithm: str, draft: Path) -> None:
    from specserve.models.draft_loader import detect_layout

    layout = detect_layout(draft)
    if layout not in LAYOUTS[algorithm]:
        right = next(name for name, layouts in LAYOUTS.items() if layout in layouts)
        raise ValueError(f"{draft} is {_LAYOUT_NAMES[layout]}: use --speculative-algorithm {right}")


def head_default_tree(spec: SpecConfig) -> SpecConfig:
    """With no tree flags (--speculative-num-steps omitted), the tree the head's config names
    as the one it was tuned with (`specserve_default_tree`: [steps, topk, draft tokens]), or
    for a target on the CPU its `specserve_cpu_tree` where it names one (there each verified
    row costs the integer products again, so a short chain pays where a wide tree does not),
    ahead of SGLang's choice by architecture; and the batch tree (batch_tree.py) resolved:
    auto takes the head's `specserve_batch_tree` with the head's own GPU tree, else off."""
    try:
        config = json.loads((spec.draft_path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    cpu_tree = config.get("specserve_cpu_tree") if spec.on_cpu else None
    tree, from_head = cpu_tree or config.get("specserve_default_tree"), spec.num_steps is None
    if from_head and tree is not None:
        steps, topk, n = (int(v) for v in tree)
        where = " on the CPU" if cpu_tree else ""
        logger.info("Draft tree %d,%d,%d (steps, topk, draft tokens): the head's own default%s", steps, topk, n, where)
        spec = replace(spec, num_steps=steps, eagle_topk=topk, num_draft_tokens=n)
    gpu_tree = from_head and tree is not None and cpu_tree is None
    batch = batch_tree.resolve(spec.batch_tree, config.get("specserve_batch_tree"), gpu_tree)
    return replace(spec, batch_tree=batch)


def draft_kv_shape(spec: SpecConfig, target: LlamaConfig) -> tuple[int, int, int]:
    """A head's own KV pool over the target's slots: one layer of the target's KV shape
    (the published heads), counted in the KV budget rather than left to the headroom."""
    return 1, target.num_kv_heads, target.head_dim


EAGLE = register(Algorithm(
    name="EAGLE", aliases=("NEXTN",), summary="EAGLE-2 heads, or the target's own MTP layers",
    make_proposer=make_proposer, draft_model="optional", has_default_draft=has_shipped_head,
    no_draft_note="the target's own MTP layers will be the draft", token_map="supported", batch_tree=True,
    prefix_backoff=1, draft_headroom_mb=2 * 1024, defaults=defaults, resolve=resolve, draft_kv_shape=draft_kv_shape))
EAGLE3 = replace(EAGLE, name="EAGLE3", aliases=(), summary="EAGLE-3 heads (the default model ships one)",
                 draft_model="required", no_draft_note="", token_map="ignored",
                 token_map_note="EAGLE3 models already have a draft vocabulary")
register(EAGLE3)
