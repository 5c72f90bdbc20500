"""Build the speculative worker for a Config: the only place that maps an algorithm name
to a proposer. The scheduler receives a SpecWorker (or None) and nothing else."""
from __future__ import annotations

from specserve.args import resolve_spec_defaults
from specserve.config import SpecConfig
from specserve.engine.kv_manager import KVManager
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


def make_spec_worker(spec: SpecConfig, runner: ModelRunner, kv: KVManager, eos_ids: frozenset[int],
                     context_length: int, architecture: str, max_running: int) -> SpecWorker | None:
    if not spec.enabled:
        return None
    if spec.algorithm in EAGLE_FAMILY:
        from specserve.spec.eagle import head_default_tree

        spec = head_default_tree(spec, runner)
    spec = resolve_spec_defaults(spec, architecture)
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
