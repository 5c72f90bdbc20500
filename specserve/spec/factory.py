"""Build the speculative worker for a Config: the only place that maps an algorithm name
to a proposer. The scheduler receives a SpecWorker (or None) and nothing else.

`resolve_spec` settles everything the config files decide, before any weights load: where
the draft comes from (an explicit path, the head shipped for a catalogue model, or the
target's own MTP layers), that a token map and a draft's vocabulary fit the target, and the
tree (the head's own default, then SGLang's auto rules). Start-up calls it once, so a bad
draft path fails in seconds and everything sized by the tree is sized by the final one.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from specserve.args import resolve_spec_defaults
from specserve.config import SpecConfig
from specserve.engine.kv_manager import KVManager
from specserve.models.loader import read_hf_config
from specserve.models.mtp import has_mtp_layers
from specserve.models.shipped_heads import shipped_head
from specserve.models.source import resolve_model_dir
from specserve.models.token_map import load_token_map
from specserve.runner.model_runner import ModelRunner
from specserve.spec.worker import SpecWorker


EAGLE_FAMILY = frozenset({"EAGLE", "EAGLE3"})  # NEXTN is normalised to EAGLE at parse time


def prefix_backoff(spec: SpecConfig) -> int:
    """Cached-prefix positions EAGLE recomputes: the last one's draft KV may pair with
    another request's next token (spec/eagle.py)."""
    return 1 if spec.algorithm in EAGLE_FAMILY else 0


def draft_kv_shape(spec: SpecConfig) -> tuple[int, int, int] | None:
    """(layers, KV heads, head dim) of a STANDALONE draft's own KV pool, which has a slot for
    each of the target's (the runner sizes its KV budget with it); None otherwise."""
    if not spec.enabled or spec.algorithm != "STANDALONE":
        return None
    from specserve.spec.standalone import kv_shape

    return kv_shape(spec)


def explicit_draft_dir(spec: SpecConfig) -> Path | None:
    """The local directory of --speculative-draft-model-path, fetched or converted once; None
    without one, or for NGRAM (which has no draft model). ValueError for a bad path."""
    if spec.draft_model_path is None or spec.algorithm in (None, "NGRAM"):
        return None
    return resolve_model_dir(spec.draft_model_path, spec.draft_model_revision, spec.draft_load_format or "auto")


def draft_source(spec: SpecConfig, model_dir: Path) -> Path | None:
    """Where the draft loads from: the explicit path, else (EAGLE family) the head shipped
    for this catalogue model, else the target itself when it has MTP layers."""
    explicit = explicit_draft_dir(spec)
    if explicit is not None or spec.algorithm not in EAGLE_FAMILY:
        return explicit
    head = shipped_head(model_dir, spec.algorithm)
    if head is not None:
        return head
    if not has_mtp_layers(model_dir):
        raise ValueError(f"--speculative-algorithm {spec.algorithm} needs --speculative-draft-model-path: "
                         f"the target model has no MTP layers to draft with")
    return model_dir


def resolve_spec(spec: SpecConfig, model_dir: Path, architecture: str, vocab_size: int) -> SpecConfig:
    """The speculative config with its draft directory, checks and tree settled from config
    files alone (module docstring); idempotent. ValueError names what is wrong."""
    if not spec.enabled:
        return spec
    if spec.draft_dir is None:
        draft = draft_source(spec, model_dir)
        spec = replace(spec, draft_dir=str(draft) if draft is not None else None)
    if spec.token_map is not None and spec.algorithm == "EAGLE":  # EAGLE3: warned at parse time
        load_token_map(spec.token_map, vocab_size)
    if spec.algorithm == "STANDALONE":
        _check_draft_llm(spec, vocab_size)
    if spec.algorithm in EAGLE_FAMILY:
        from specserve.spec.eagle import head_default_tree

        spec = head_default_tree(spec)
    return resolve_spec_defaults(spec, architecture)


def _check_draft_llm(spec: SpecConfig, vocab_size: int) -> None:
    if spec.draft_model_quantization not in (None, "unquant"):
        raise ValueError(f"--speculative-draft-model-quantization {spec.draft_model_quantization} "
                         "is not supported yet (supported: unquant)")
    draft_vocab = read_hf_config(Path(spec.draft_dir))["vocab_size"]
    if draft_vocab != vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft_vocab}) differs from the target's "
                         f"({vocab_size}): STANDALONE needs a draft with the same tokenizer")


def make_spec_worker(spec: SpecConfig, runner: ModelRunner, kv: KVManager, eos_ids: frozenset[int],
                     context_length: int, max_running: int) -> SpecWorker | None:
    """The worker for a spec config that `resolve_spec` has settled (None without speculation)."""
    if not spec.enabled:
        return None
    assert spec.num_steps is not None, "resolve_spec runs at start-up, before the engine is built"
    if spec.algorithm == "NGRAM":
        from specserve.spec.ngram import NgramProposer
        from specserve.spec.proposer import NgramAdapter

        proposer = NgramAdapter(NgramProposer(
            min_window=spec.ngram_min_match_window_size, max_window=spec.ngram_max_match_window_size,
            min_bfs_breadth=spec.ngram_min_bfs_breadth, max_bfs_breadth=spec.ngram_max_bfs_breadth,
            match_type=spec.ngram_match_type, branch_length=spec.ngram_branch_length,
            capacity=spec.ngram_capacity, num_draft_tokens=spec.num_draft_tokens))
    elif spec.algorithm == "STANDALONE":
        from specserve.spec.standalone import StandaloneProposer

        proposer = StandaloneProposer(spec, runner, kv, max_running)
    elif spec.algorithm in EAGLE_FAMILY:
        from specserve.spec.eagle import EagleProposer

        proposer = EagleProposer(spec, runner, kv, max_running)
    else:
        raise ValueError(f"speculative algorithm {spec.algorithm} is not implemented yet")
    return SpecWorker(spec, runner, kv, proposer, eos_ids, context_length)
