"""NGRAM: drafts from a global n-gram trie of prompts and outputs; no draft model.

trie.py counts the n-grams, proposer.py matches a request's recent tokens against them and
builds its tree (BFS by recency or PROB by frequency), adapter.py puts that behind the
`Proposer` protocol; lookup.py drafts chains on the device for pipelined steps (opt-in:
SPECSERVE_NGRAM_ON_DEVICE). This file is the registry entry: which flags apply, their checks
(SGLang's NGRAM constructor rules, with our flag names) and defaults.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from specserve.core.config import ConfigError, SpecConfig
from specserve.spec.registry import Algorithm, register

if TYPE_CHECKING:
    from specserve.engine.kv_manager import KVManager
    from specserve.runner.model_runner import ModelRunner
    from specserve.spec.proposer import Proposer

MATCH_TYPES = ("BFS", "PROB")
_FLAG = "--speculative-ngram-"


def make_proposer(spec: SpecConfig, runner: ModelRunner, kv: KVManager, max_running: int) -> Proposer:
    from specserve.spec.ngram.adapter import NgramAdapter
    from specserve.spec.ngram.proposer import NgramProposer

    return NgramAdapter(NgramProposer(
        min_window=spec.ngram_min_match_window_size, max_window=spec.ngram_max_match_window_size,
        min_bfs_breadth=spec.ngram_min_bfs_breadth, max_bfs_breadth=spec.ngram_max_bfs_breadth,
        match_type=spec.ngram_match_type, branch_length=spec.ngram_branch_length,
        capacity=spec.ngram_capacity, num_draft_tokens=spec.tree[2]))


def check_flags(spec: SpecConfig) -> SpecConfig:
    """The NGRAM cache constructor's checks (internals §1.14), with our flag names."""
    lo_w, hi_w, branch = spec.ngram_min_match_window_size, spec.ngram_max_match_window_size, spec.ngram_branch_length
    lo_b, hi_b = spec.ngram_min_bfs_breadth, spec.ngram_max_bfs_breadth
    f_lo_w, f_hi_w, f_branch = f"{_FLAG}min-match-window-size", f"{_FLAG}max-match-window-size", f"{_FLAG}branch-length"
    f_lo_b, f_hi_b = f"{_FLAG}min-bfs-breadth", f"{_FLAG}max-bfs-breadth"
    for failed, message in (
        (branch <= 1, f"{f_branch} must be > 1, got {branch}"),
        (lo_w <= 0, f"{f_lo_w} must be > 0, got {lo_w}"),
        (lo_w > hi_w, f"{f_lo_w} ({lo_w}) must be <= {f_hi_w} ({hi_w})"),
        (hi_w >= branch, f"{f_hi_w} ({hi_w}) must be < {f_branch} ({branch})"),
        (lo_b <= 0, f"{f_lo_b} must be > 0, got {lo_b}"),
        (lo_b > hi_b, f"{f_lo_b} ({lo_b}) must be <= {f_hi_b} ({hi_b})"),
    ):
        if failed:
            raise ConfigError(message)
    if spec.ngram_match_type.upper() not in MATCH_TYPES:
        raise ConfigError(f"{_FLAG}match-type must be BFS or PROB, got {spec.ngram_match_type}")
    return replace(spec, ngram_match_type=spec.ngram_match_type.upper())


def defaults(spec: SpecConfig, architecture: str | None) -> SpecConfig:
    """SGLang's: topk = max BFS breadth, N = the max match window unless given; steps is
    bookkeeping only (N // topk, as SGLang 0.5.23 sets it)."""
    topk = spec.ngram_max_bfs_breadth
    n = spec.ngram_max_match_window_size if spec.num_draft_tokens is None else spec.num_draft_tokens
    return replace(spec, eagle_topk=topk, num_draft_tokens=n, num_steps=max(1, n // topk))


NGRAM = register(Algorithm(
    name="NGRAM", make_proposer=make_proposer, summary="n-gram matching over prompts and outputs; no draft model",
    draft_model="none", tree_flags=False, ngram_flags=True, spec_v2=False, greedy_verify_env=True,
    defaults=defaults, check_flags=check_flags,
    cpu_note="NGRAM speculative decoding runs on CPU in specserve (SGLang only supports it on CUDA)"))
