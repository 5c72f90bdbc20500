"""Validation and auto-defaults for a parsed `Config`: SGLang's server-args rules, our way.

This file owns every rule that turns what the user typed into a `Config` the engine can trust:
range checks, "not supported yet" refusals, and the speculative-decoding rules of SGLang's
`_handle_speculative_decoding` (internals note §2.2-2.4), including their error and warning
wording. The speculative rules read the chosen algorithm's registry entry
(spec/registry.py: which flags apply to it, its own checks and defaults), never its name.
It knows nothing about argparse: `specserve/args.py` declares the flags, builds a `Config`
and calls `check_config`. Each rule is a small function `(Config, CheckContext) -> Config`;
`RULES` is their order. Errors are `ConfigError` with a one-line message; warnings go to
the "specserve" logger.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from specserve.args_parallel import check_parallel
from specserve.core.config import Config, ConfigError
from specserve.server.tool_parsers import TOOL_CALL_PARSERS
from specserve.spec import registry
from specserve.spec.eagle.batch_tree import AUTO, OFF, parse_tree

logger = logging.getLogger("specserve")

@dataclass(frozen=True)
class CheckContext:
    """What the rules need besides the Config itself."""

    explicit: Mapping[str, str] = field(default_factory=dict)  # dest -> flag, for typed flags
    device_has_cuda: bool | None = None  # None: ask torch, only if a rule needs to know
    architecture: str | None = None  # HF `architectures[0]` of the target, when known

    def has_cuda(self) -> bool:
        if self.device_has_cuda is not None:
            return self.device_has_cuda
        try:  # imported lazily: parsing --help must not pay for importing torch
            import torch
        except ImportError:
            return False
        return bool(torch.cuda.is_available())


Rule = Callable[[Config, CheckContext], Config]


def _with_spec(cfg: Config, **changes: Any) -> Config:
    return replace(cfg, spec=replace(cfg.spec, **changes))


# ---- ranges -------------------------------------------------------------------------------

def _flag(section: str, name: str) -> str:
    """The flag that sets `cfg.<section>.<name>` (spec fields carry SGLang's prefix)."""
    prefix = "speculative-" if section == "spec" else ""
    return f"--{prefix}{name.replace('_', '-')}"


_AT_LEAST_1 = (
    ("cache", "max_total_tokens"), ("cache", "page_size"), ("model", "context_length"),
    ("scheduler", "max_running_requests"), ("scheduler", "max_prefill_tokens"),
    ("scheduler", "decode_log_interval"), ("scheduler", "num_continuous_decode_steps"),
    ("runner", "cuda_graph_max_bs"),
    ("runner", "torch_compile_max_bs"), ("runner", "tp_size"), ("runner", "cpu_threads"), ("spec", "num_steps"),
    ("spec", "eagle_topk"), ("spec", "num_draft_tokens"), ("spec", "ngram_capacity"),
    ("spec", "batch_tree_from"), ("server", "max_choices_per_request"), ("server", "tokenizer_worker_num"),
)
_RANGES: tuple[tuple[str, str, Callable[[Any], bool], str], ...] = (
    ("server", "port", lambda v: 1 <= v <= 65535, "in 1..65535"),
    ("cache", "mem_fraction_static", lambda v: 0 < v < 1, "in (0, 1)"),
    ("scheduler", "chunked_prefill_size", lambda v: v == -1 or v >= 1, "-1 (no chunking) or >= 1"),
    ("runner", "cuda_graph_max_prefill_tokens", lambda v: v >= 0, ">= 0 (0: prefill eagerly)"),
    ("spec", "accept_threshold_single", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("spec", "accept_threshold_acc", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("server", "max_request_mb", lambda v: v > 0, "> 0"),
    ("server", "graceful_shutdown_timeout", lambda v: v >= 0, ">= 0"),
    ("server", "watchdog_timeout", lambda v: v > 0, "> 0"),
    *((section, name, lambda v: v >= 1, ">= 1") for section, name in _AT_LEAST_1),
)


def check_ranges(cfg: Config, ctx: CheckContext) -> Config:
    for section, name, ok, want in _RANGES:
        value = getattr(getattr(cfg, section), name)
        if value is not None and not ok(value):
            raise ConfigError(f"{_flag(section, name)} must be {want}, got {value}")
    return cfg


# ---- things specserve does not do (yet) ---------------------------------------------------

def _check_quantization(flag: str, value: str | None, allowed: tuple[str | None, ...]) -> None:
    if value not in allowed:
        supported = ", ".join(v for v in allowed if v is not None)
        raise ConfigError(f"{flag} {value} is not supported yet (supported: {supported})")


def check_unsupported(cfg: Config, ctx: CheckContext) -> Config:
    page = cfg.cache.page_size
    if page > 1:
        raise ConfigError(f"--page-size {page}: page sizes above 1 are not supported yet "
                          "(the KV cache is allocated per token)")
    _check_quantization("--quantization", cfg.model.quantization, (None, "fp8", "awq", "gptq", "gguf", "none"))
    # "unquant": SGLang's way to keep the draft in float under a quantized target
    _check_quantization("--speculative-draft-model-quantization",
                        cfg.spec.draft_model_quantization, (None, "fp8", "awq", "gptq", "unquant"))
    if cfg.model.device == "cuda" and not ctx.has_cuda():
        raise ConfigError("--device cuda: no CUDA device found")
    for flag, value in (("--speculative-moe-runner-backend", cfg.spec.moe_runner_backend),
                        ("--speculative-moe-a2a-backend", cfg.spec.moe_a2a_backend)):
        if value is not None:
            raise ConfigError(f"{flag} is not supported: specserve serves dense models only")
    if cfg.model.trust_remote_code:
        logger.info("--trust-remote-code is not needed: specserve runs its built-in "
                    "architectures and never executes code from a model repository")
    if "speculative_attention_mode" in ctx.explicit:
        logger.info("--speculative-attention-mode %s changes nothing here: one attention kernel runs "
                    "verify and draft extend in either mode", cfg.spec.attention_mode)
    return cfg


KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # cache/kv_pool.py stores these ("fp8": vLLM's name for e4m3)


def check_kv_cache_dtype(cfg: Config, ctx: CheckContext) -> Config:
    """--kv-cache-dtype: SGLang's names; the GPU's fp8 support is checked where the pool is
    sized (runner/memory.py), once the device is known."""
    value = cfg.cache.kv_cache_dtype.lower()
    value = "fp8_e4m3" if value == "fp8" else value
    if value == "fp8_e5m2":
        raise ConfigError("--kv-cache-dtype fp8_e5m2 is not supported: use fp8_e4m3 or auto")
    if value not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype {cfg.cache.kv_cache_dtype}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    return replace(cfg, cache=replace(cfg.cache, kv_cache_dtype=value))


def check_tool_call_parser(cfg: Config, ctx: CheckContext) -> Config:
    """--tool-call-parser: SGLang's names (and vLLM's hermes); server/tool_parsers.py reads them."""
    name = cfg.server.tool_call_parser
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise ConfigError(f"--tool-call-parser {name}: expected one of {', '.join(TOOL_CALL_PARSERS)}")
    return cfg


# ---- speculative decoding -----------------------------------------------------------------
# Each rule reads the chosen algorithm's registry entry (spec/registry.py), never its name.

def _algo(cfg: Config) -> registry.Algorithm | None:
    return registry.get(cfg.spec.algorithm) if cfg.spec.algorithm is not None else None


def _those(has: Callable[[registry.Algorithm], bool]) -> str:
    """The names of the algorithms that `has`, as 'A', 'A and B' or 'A, B and C'."""
    found = [a.name for a in registry.algorithms() if has(a)]
    return found[0] if len(found) == 1 else ", ".join(found[:-1]) + " and " + found[-1]


def normalize_algorithm(cfg: Config, ctx: CheckContext) -> Config:
    algo = cfg.spec.algorithm
    if algo is None:
        return cfg
    try:
        return _with_spec(cfg, algorithm=registry.canonical(algo))  # NEXTN is EAGLE's alias
    except KeyError:
        raise ConfigError(f"--speculative-algorithm must be one of {', '.join(registry.names())}, "
                          f"got {algo.upper()}") from None


def reject_stray_spec_flags(cfg: Config, ctx: CheckContext) -> Config:
    """A speculative flag without an algorithm is a mistake, not something to ignore."""
    if cfg.spec.algorithm is None:
        for dest, flag in ctx.explicit.items():
            if dest.startswith("speculative_") or dest == "enable_multi_layer_eagle":
                raise ConfigError(f"{flag} requires --speculative-algorithm")
    return cfg


def check_algorithm_flags(cfg: Config, ctx: CheckContext) -> Config:
    """The algorithm's own flag checks (NGRAM's window and breadth rules)."""
    algo = _algo(cfg)
    return replace(cfg, spec=algo.check_flags(cfg.spec)) if algo is not None else cfg


def check_spec_v2(cfg: Config, ctx: CheckContext) -> Config:
    # Checked on the *typed* topk, before auto-tuning, exactly as SGLang does: an omitted topk
    # that auto-resolves to 4 (Llama) is not caught here (spec/tree_rules.py warns instead).
    algo, s = _algo(cfg), cfg.spec
    if not s.enable_spec_v2 or algo is None:
        return cfg
    if not algo.spec_v2:
        raise ConfigError(f"Spec v2 does not support {algo.name} speculative decoding; unset "
                          "SPECSERVE_ENABLE_SPEC_V2 / SGLANG_ENABLE_SPEC_V2")
    if s.eagle_topk is not None and s.eagle_topk > 1:
        raise ConfigError("Spec v2 currently only supports topk = 1 for speculative decoding.")
    return cfg


def check_step_triple(cfg: Config, ctx: CheckContext) -> Config:
    s, algo = cfg.spec, _algo(cfg)
    if algo is not None and algo.tree_flags:
        given = [v is not None for v in (s.num_steps, s.eagle_topk, s.num_draft_tokens)]
        if any(given) and not all(given):
            raise ConfigError("set all three of --speculative-num-steps, --speculative-eagle-topk, "
                              "--speculative-num-draft-tokens, or none for auto-tuning")
    return cfg


def check_batch_tree(cfg: Config, ctx: CheckContext) -> Config:
    """--speculative-batch-tree's syntax, and that the algorithm drafts one (EAGLE's step
    graphs); its fit with the main tree is checked once that is known (spec/eagle/batch_tree.py)."""
    s, algo = cfg.spec, _algo(cfg)
    if s.batch_tree == AUTO:
        return cfg
    try:
        parse_tree(s.batch_tree)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if s.batch_tree != OFF and algo is not None and not algo.batch_tree:
        raise ConfigError(f"--speculative-batch-tree applies to --speculative-algorithm "
                          f"{_those(lambda a: a.batch_tree)} only, not {algo.name}")
    return cfg


def require_draft_model(cfg: Config, ctx: CheckContext) -> Config:
    s, algo = cfg.spec, _algo(cfg)
    if algo is None or algo.draft_model == "none":
        return cfg
    if s.draft_model_path is None and algo.has_default_draft(cfg.model.model_path, algo.name):
        logger.info("No --speculative-draft-model-path: drafting with the %s head shipped for %s",
                    algo.name, cfg.model.model_path)
        return cfg
    if s.draft_model_path is None and algo.draft_model == "required":
        raise ConfigError(f"--speculative-algorithm {algo.name} requires --speculative-draft-model-path")
    if s.draft_model_path is None and algo.no_draft_note:
        # whether a draft is found without it is decided at start-up, once the model is read
        logger.info("No --speculative-draft-model-path: %s", algo.no_draft_note)
    if s.draft_model_path is not None and s.draft_model_revision is None:
        return _with_spec(cfg, draft_model_revision="main")
    return cfg


_DRAFT_ONLY = ("speculative_draft_model_path", "speculative_draft_model_revision",
               "speculative_draft_load_format", "speculative_token_map",
               "speculative_draft_attention_backend", "speculative_draft_model_quantization")


def check_draft_options(cfg: Config, ctx: CheckContext) -> Config:
    """--speculative-token-map and random draft weights, where the algorithm's draft takes them."""
    algo, s = _algo(cfg), cfg.spec
    if algo is None or algo.draft_model == "none":
        return cfg  # its draft flags are warned about below
    if s.token_map is not None and algo.token_map == "refused":
        raise ConfigError(f"--speculative-token-map (FR-Spec) is supported for --speculative-algorithm "
                          f"{_those(lambda a: a.token_map == 'supported')} only")
    if s.draft_load_format == "dummy" and not algo.dummy_draft:
        raise ConfigError(f"--speculative-draft-load-format dummy is supported for --speculative-algorithm "
                          f"{_those(lambda a: a.dummy_draft)} only (a draft LLM of random weights, for benchmarks)")
    if s.token_map is not None and algo.token_map == "ignored":
        logger.warning("--speculative-token-map is ignored for %s: %s", algo.name, algo.token_map_note)
    return cfg


def warn_ignored_spec_flags(cfg: Config, ctx: CheckContext) -> Config:
    """Flags that do not apply to the chosen algorithm: warned about, never silently dropped."""
    algo = _algo(cfg)
    if algo is None:
        return cfg
    for dest, flag in ctx.explicit.items():
        if not algo.ngram_flags and dest.startswith("speculative_ngram_"):
            logger.warning("%s is ignored: it applies only to --speculative-algorithm %s", flag,
                           _those(lambda a: a.ngram_flags))
        if algo.draft_model == "none" and dest in _DRAFT_ONLY:
            logger.warning("%s is ignored for %s: it has no draft model", flag, algo.name)
        if not algo.tree_flags and dest in ("speculative_eagle_topk", "speculative_num_steps"):
            logger.warning("%s is ignored for %s: its tree comes from its own flags", flag, algo.name)
    return cfg


def warn_lossy_thresholds(cfg: Config, ctx: CheckContext) -> Config:
    for name in ("accept_threshold_single", "accept_threshold_acc"):
        flag, value = _flag("spec", name), getattr(cfg.spec, name)
        if cfg.spec.enabled and value < 1.0:
            logger.warning("%s=%s < 1.0: verification is no longer lossless (outputs no longer "
                           "follow the target model's distribution exactly)", flag, value)
    return cfg


def check_deterministic(cfg: Config, ctx: CheckContext) -> Config:
    """--enable-deterministic-inference covers one GPU (or CPU) in the model's dtype, every
    --quantization included (models/invariant.py), verified exactly: what it does not cover
    yet is refused, never silently inexact."""
    if not cfg.runner.enable_deterministic_inference:
        return cfg
    flag = "--enable-deterministic-inference"
    refused = {
        "--tp-size > 1": cfg.runner.tp_size > 1 or cfg.runner.nnodes > 1,
        "--enable-torch-compile": cfg.runner.enable_torch_compile,
        "--speculative-accept-threshold-* below 1.0": (cfg.spec.accept_threshold_single < 1.0
                                                       or cfg.spec.accept_threshold_acc < 1.0),
    }
    for what, on in refused.items():
        if on:
            raise ConfigError(f"{flag} with {what} is not supported yet")
    return cfg


def note_on_cpu(cfg: Config, ctx: CheckContext) -> Config:
    algo, device = _algo(cfg), cfg.model.device
    if algo is None or not algo.cpu_note:  # before has_cuda(): only then may torch be imported
        return cfg
    if device == "cpu" or (device == "auto" and not ctx.has_cuda()):
        logger.info(algo.cpu_note)
    return cfg


def default_max_running_requests(cfg: Config, ctx: CheckContext) -> Config:
    if not cfg.spec.enabled or cfg.scheduler.max_running_requests is not None:
        return cfg
    logger.warning("Max running requests is reset to 48 for speculative decoding. You can "
                   "override this by explicitly setting --max-running-requests.")
    return replace(cfg, scheduler=replace(cfg.scheduler, max_running_requests=48))


def apply_spec_defaults(cfg: Config, ctx: CheckContext) -> Config:
    """The algorithm's auto rules; without the architecture (parse time) an omitted EAGLE
    tree stays unset, and start-up resolves it (spec/registry.py `plan`)."""
    return replace(cfg, spec=registry.resolve_defaults(cfg.spec, ctx.architecture))


# SGLang's order where it has one: the Spec v2 topk check runs before auto-tuning.
RULES: tuple[Rule, ...] = (
    normalize_algorithm, reject_stray_spec_flags, check_ranges, check_deterministic, check_algorithm_flags,
    check_unsupported, check_kv_cache_dtype, check_tool_call_parser, check_parallel, check_spec_v2,
    check_step_triple, check_batch_tree, require_draft_model, check_draft_options, warn_ignored_spec_flags,
    warn_lossy_thresholds, note_on_cpu, default_max_running_requests, apply_spec_defaults,
)


def check_config(cfg: Config, ctx: CheckContext | None = None) -> Config:
    """Run every rule in order; the first violated one raises ConfigError."""
    ctx = ctx if ctx is not None else CheckContext()
    for rule in RULES:
        cfg = rule(cfg, ctx)
    return cfg
