"""The speculative algorithms: one `Algorithm` entry each, registered once.

This is the only place an algorithm's name maps to behaviour. An entry says which flags
apply to it and how (the command-line rules in args_check.py read these fields, never a
name), how its defaults are chosen, what start-up resolves for it before any weights load
(its draft's directory, the tree a shipped head names), what memory it needs, and the
function that builds its proposer. Each proposer package under spec/ registers its entries
when imported (`spec/ngram/__init__.py`, `spec/standalone/__init__.py`,
`spec/eagle/__init__.py`); `BUILTIN` lists those packages, imported on first look-up so
that parsing a command line imports no torch.

`plan(spec, model_dir, target)` turns a parsed SpecConfig into a `Plan`: the config with
everything settled, the engine's `SpecNeeds`, and `build`, which the engine process calls
to get its `SpecWorker`. A Plan is picklable: `make_proposer` must be a module-level
function, so a plug-in registered outside specserve (a test's toy proposer) reaches the
engine process by its module name.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from specserve.core.config import SpecConfig

if TYPE_CHECKING:
    from specserve.engine.kv_manager import KVManager
    from specserve.engine.speculation import SpecNeeds
    from specserve.models.llama import LlamaConfig
    from specserve.runner.model_runner import ModelRunner
    from specserve.spec.proposer import Proposer
    from specserve.spec.worker import SpecWorker

BUILTIN = ("specserve.spec.ngram", "specserve.spec.standalone", "specserve.spec.eagle")

MakeProposer = Callable[[SpecConfig, "ModelRunner", "KVManager", int], "Proposer"]
Defaults = Callable[[SpecConfig, "str | None"], SpecConfig]
Resolve = Callable[[SpecConfig, Path, "LlamaConfig"], SpecConfig]


def _keep(spec: SpecConfig, *args: object) -> SpecConfig:
    return spec


@dataclass(frozen=True)
class Algorithm:
    """Everything specserve knows about one speculative algorithm."""

    name: str  # what --speculative-algorithm takes (upper case)
    make_proposer: MakeProposer  # (resolved spec, runner, kv, max_running) -> Proposer; module-level
    summary: str = ""  # one line for --help and the docs
    aliases: tuple[str, ...] = ()  # other names for it (NEXTN for EAGLE)
    # --speculative-draft-model-path: "none" (ignored, with a warning), "required", or
    # "optional" (resolve() finds a draft without it, or fails with its own message)
    draft_model: Literal["none", "required", "optional"] = "required"
    has_default_draft: Callable[[str, str], bool] = lambda model_path, name: False  # a shipped head for --model
    no_draft_note: str = ""  # logged when an optional draft path is omitted
    tree_flags: bool = True  # steps / topk / num-draft-tokens shape its drafts (all three or none)
    batch_tree: bool = False  # --speculative-batch-tree applies (EAGLE's step graphs)
    token_map: Literal["supported", "ignored", "refused"] = "refused"  # --speculative-token-map
    token_map_note: str = ""  # why it is ignored
    dummy_draft: bool = False  # --speculative-draft-load-format dummy (random draft weights)
    ngram_flags: bool = False  # the --speculative-ngram-* flags apply
    spec_v2: bool = True  # may run with SPECSERVE_ENABLE_SPEC_V2
    greedy_verify_env: bool = False  # SPECSERVE_NGRAM_FORCE_GREEDY_VERIFY applies
    prefix_backoff: int = 0  # cached-prefix positions recomputed when a prefix is borrowed
    draft_headroom_mb: int = 0  # GPU memory kept back for its draft's weights, trees and graphs
    defaults: Defaults = _keep  # the auto rules for omitted flags (spec, target architecture)
    check_flags: Callable[[SpecConfig], SpecConfig] = _keep  # its own flag checks at parse time
    resolve: Resolve = _keep  # start-up, before weights: draft directory, the head's tree, checks
    # its draft's own KV per target slot, (layers, KV heads, head dim), from the resolved spec
    draft_kv_shape: Callable[[SpecConfig, LlamaConfig], tuple[int, int, int] | None] = \
        lambda spec, target: None
    cpu_note: str = ""  # logged when it runs on a CPU

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


_ALGORITHMS: dict[str, Algorithm] = {}  # every name and alias -> its entry
_loaded = False


def register(algorithm: Algorithm) -> Algorithm:
    """Add `algorithm` under its name and aliases (ValueError if one is taken)."""
    for name in algorithm.names:
        if name.upper() != name:
            raise ValueError(f"speculative algorithm names are upper case, got {name!r}")
        if name in _ALGORITHMS and _ALGORITHMS[name] is not algorithm:
            raise ValueError(f"speculative algorithm {name} is registered already")
    for name in algorithm.names:
        _ALGORITHMS[name] = algorithm
    return algorithm


def unregister(name: str) -> None:
    """Remove the entry registered under `name` and its aliases (tests' plug-ins)."""
    algorithm = _ALGORITHMS.get(name)
    for alias in algorithm.names if algorithm is not None else ():
        _ALGORITHMS.pop(alias, None)


def _load_builtin() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN:
            importlib.import_module(module)


def names() -> tuple[str, ...]:
    """Every name --speculative-algorithm accepts, aliases included, in registration order."""
    _load_builtin()
    return tuple(_ALGORITHMS)


def algorithms() -> tuple[Algorithm, ...]:
    """Every registered entry once, in registration order."""
    _load_builtin()
    return tuple(dict.fromkeys(_ALGORITHMS.values()))


def get(name: str) -> Algorithm:
    """The entry for `name` or an alias (case-insensitive); KeyError if there is none."""
    _load_builtin()
    return _ALGORITHMS[name.upper()]


def canonical(name: str) -> str:
    """The entry's own name for `name` (NEXTN -> EAGLE)."""
    return get(name).name


@dataclass(frozen=True)
class Plan:
    """A speculative set-up resolved at start-up (module docstring); engine/speculation.py
    `SpecPlan` is the engine's view of it."""

    spec: SpecConfig
    needs: SpecNeeds
    make_proposer: MakeProposer
    force_greedy_verify: bool = False

    def build(self, runner: ModelRunner, kv: KVManager, eos_ids: frozenset[int], context_length: int,
              max_running: int) -> SpecWorker:
        from specserve.spec.worker import SpecWorker

        proposer = self.make_proposer(self.spec, runner, kv, max_running)
        return SpecWorker(self.spec, runner, kv, proposer, eos_ids, context_length,
                          force_greedy_verify=self.force_greedy_verify)


def plan(spec: SpecConfig, model_dir: Path, target: LlamaConfig) -> Plan | None:
    """The Plan for a parsed SpecConfig (None without speculation): the algorithm's start-up
    resolution, then its defaults for the target's architecture. ValueError names what
    is wrong (a draft path, a token map, a vocabulary)."""
    if spec.algorithm is None:
        return None
    from specserve.engine.speculation import SpecNeeds

    algo = get(spec.algorithm)
    spec = algo.resolve(spec, model_dir, target)
    spec = resolve_defaults(spec, target.architecture)
    needs = SpecNeeds(draft_headroom_mb=algo.draft_headroom_mb, draft_kv_shape=algo.draft_kv_shape(spec, target),
                      prefix_backoff=algo.prefix_backoff, verify_tokens=spec.num_draft_tokens or 0)
    force = spec.ngram_force_greedy_verify and algo.greedy_verify_env
    return Plan(replace(spec, algorithm=algo.name), needs, algo.make_proposer, force)


def resolve_defaults(spec: SpecConfig, architecture: str | None) -> SpecConfig:
    """The algorithm's auto rules for omitted flags; idempotent. Parsing calls it with no
    architecture (an omitted EAGLE tree stays unset), start-up again with the target's."""
    if spec.algorithm is None:
        return spec
    return get(spec.algorithm).defaults(spec, architecture)
