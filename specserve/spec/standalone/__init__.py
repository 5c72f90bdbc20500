"""STANDALONE: a small LLM with the target's tokenizer drafts a chain (topk 1) or a tree.

proposer.py is the proposer; this file is the registry entry: a required draft path (or
random draft weights for benchmarks), checked at start-up for its vocabulary (and an
FR-Spec `--speculative-token-map`, which cuts the draft's lm_head), its own KV pool sized
with the target's, and SGLang's (3, 1, 4) when the tree flags are omitted.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from specserve.core.config import SpecConfig
from specserve.spec.registry import Algorithm, register
from specserve.spec.sources import explicit_draft_dir
from specserve.spec.tree_rules import tree_defaults

if TYPE_CHECKING:
    from specserve.engine.kv_manager import KVManager
    from specserve.models.llama import LlamaConfig
    from specserve.runner.model_runner import ModelRunner
    from specserve.spec.proposer import Proposer


def make_proposer(spec: SpecConfig, runner: ModelRunner, kv: KVManager, max_running: int) -> Proposer:
    from specserve.spec.standalone.proposer import StandaloneProposer

    return StandaloneProposer(spec, runner, kv, max_running)


def defaults(spec: SpecConfig, architecture: str | None) -> SpecConfig:
    return tree_defaults(spec, architecture, lambda arch: (3, 1, 4))


def resolve(spec: SpecConfig, model_dir: Path, target: LlamaConfig) -> SpecConfig:
    """The draft's directory, and that it can draft for this target."""
    from specserve.models.loader import read_hf_config

    draft = spec.draft_dir or str(explicit_draft_dir(spec))
    draft_vocab = read_hf_config(Path(draft))["vocab_size"]
    if draft_vocab != target.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft_vocab}) differs from the target's "
                         f"({target.vocab_size}): STANDALONE needs a draft with the same tokenizer")
    if spec.token_map is not None:  # FR-Spec: checked before any weight loads
        from specserve.models.token_map import load_token_map

        load_token_map(spec.token_map, target.vocab_size)
    return replace(spec, draft_dir=draft)


def draft_kv_shape(spec: SpecConfig, target: LlamaConfig) -> tuple[int, int, int]:
    """The draft LLM's own KV pool has a slot for each of the target's."""
    from specserve.models.llama import LlamaConfig
    from specserve.models.loader import read_hf_config

    c = LlamaConfig.from_hf(read_hf_config(spec.draft_path))
    return c.num_layers, c.num_kv_heads, c.head_dim


STANDALONE = register(Algorithm(
    name="STANDALONE", make_proposer=make_proposer, summary="a small LLM with the same tokenizer drafts",
    draft_model="required", dummy_draft=True, draft_headroom_mb=6 * 1024, defaults=defaults, resolve=resolve,
    draft_kv_shape=draft_kv_shape, token_map="supported"))
