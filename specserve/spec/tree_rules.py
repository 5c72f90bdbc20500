"""The draft-tree triple's rules: (steps, topk, draft tokens) for the tree drafters.

SGLang's `auto_choose_speculative_params` picks a tree when the three flags are omitted;
then, whoever chose it, topk 1 means a chain of steps + 1 nodes, and EAGLE-2 reranking keeps
the N-1 best of topk + (steps-1)*topk^2 candidates, so a larger N cannot be filled. The
registry entries of STANDALONE, EAGLE and EAGLE3 call `tree_defaults` with their own
choice of tree. No torch here: parsing a command line runs these.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from specserve.core.config import ConfigError, SpecConfig

logger = logging.getLogger("specserve")

Triple = tuple[int, int, int]
# SGLang's auto_choose_speculative_params picks (5, 4, 8) for these, (3, 1, 4) for the rest.
WIDE_TREE_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM"})


def by_architecture(architecture: str | None) -> Triple | None:
    """EAGLE's auto tree: (5, 4, 8) for Llama and Grok targets, else (3, 1, 4); None while
    the architecture is unknown (parse time: start-up asks again)."""
    if architecture is None:
        return None
    return (5, 4, 8) if architecture in WIDE_TREE_ARCHITECTURES else (3, 1, 4)


def tree_defaults(spec: SpecConfig, architecture: str | None, auto: Callable[[str | None], Triple | None]
                  ) -> SpecConfig:
    """Fill an omitted triple with `auto(architecture)`, then apply the chain and budget rules."""
    if spec.num_steps is None:
        triple = auto(architecture)
        if triple is None:
            return spec
        spec = _auto(spec, triple, architecture)
    steps, topk, n = spec.tree
    if topk == 1 and n != steps + 1:
        logger.warning("speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 "
                       "when speculative_eagle_topk == 1")
        spec = replace(spec, num_draft_tokens=steps + 1)
    check_tree_budget(spec)
    return spec


def _auto(spec: SpecConfig, triple: Triple, architecture: str | None) -> SpecConfig:
    steps, topk, n = triple
    if spec.enable_spec_v2 and topk > 1:
        # SGLang lets this through (its check ran before auto-tuning); we at least say so.
        logger.warning("Spec v2 only supports topk = 1, but auto-tuning chose "
                       "speculative_eagle_topk=%d for %s; set --speculative-eagle-topk 1 "
                       "(with --speculative-num-steps and --speculative-num-draft-tokens)",
                       topk, architecture)
    return replace(spec, num_steps=steps, eagle_topk=topk, num_draft_tokens=n)


def check_tree_budget(spec: SpecConfig) -> None:
    steps, topk, n = spec.tree
    pool = topk + (steps - 1) * topk * topk
    if n - 1 > pool:
        raise ConfigError(
            f"--speculative-num-draft-tokens {n} is too large for --speculative-num-steps {steps} "
            f"and --speculative-eagle-topk {topk}: the draft tree has topk + (steps-1)*topk^2 = "
            f"{pool} candidates, so num_draft_tokens must be <= {pool + 1}")
