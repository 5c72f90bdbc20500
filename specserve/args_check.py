"""Validation and auto-defaults for a parsed `Config`: SGLang's server-args rules, our way.

This file owns every rule that turns what the user typed into a `Config` the engine can trust:
range checks, "not supported yet" refusals, and the speculative-decoding rules of SGLang's
`_handle_speculative_decoding` (internals note §2.2-2.4), including their error and warning
wording. It knows nothing about argparse: `specserve/args.py` declares the flags, builds a
`Config` and calls `check_config`; the engine calls `resolve_spec_defaults` once it knows the
model's architecture. Each rule is a small function `(Config, CheckContext) -> Config`;
`RULES` is their order. Errors are `ConfigError` with a one-line message; warnings go to the
"specserve" logger.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from specserve.config import Config, SpecConfig
from specserve.models.shipped_heads import has_shipped_head
from specserve.spec.batch_tree import AUTO, OFF, parse_tree

logger = logging.getLogger("specserve")

SPEC_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")
TREE_ALGORITHMS = frozenset({"EAGLE", "EAGLE3", "STANDALONE"})  # steps/topk/N drafters
NGRAM_MATCH_TYPES = ("BFS", "PROB")
# Quantization is planned as gpt-fast-style weight-only transforms in their own files (DESIGN 6).
PLANNED_QUANTIZATIONS = ("int8 weight-only", "int4 weight-only")
# SGLang's auto_choose_speculative_params picks (5, 4, 8) for these, (3, 1, 4) for the rest.
WIDE_TREE_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM"})


class ConfigError(ValueError):
    """A command line or Config the engine must not start with; the message is one line."""


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
    ("runner", "torch_compile_max_bs"), ("runner", "tp_size"), ("spec", "num_steps"),
    ("spec", "eagle_topk"), ("spec", "num_draft_tokens"), ("spec", "ngram_capacity"),
    ("spec", "batch_tree_from"),
)
_RANGES: tuple[tuple[str, str, Callable[[Any], bool], str], ...] = (
    ("server", "port", lambda v: 1 <= v <= 65535, "in 1..65535"),
    ("cache", "mem_fraction_static", lambda v: 0 < v < 1, "in (0, 1)"),
    ("scheduler", "chunked_prefill_size", lambda v: v == -1 or v >= 1, "-1 (no chunking) or >= 1"),
    ("runner", "cuda_graph_max_prefill_tokens", lambda v: v >= 0, ">= 0 (0: prefill eagerly)"),
    ("spec", "accept_threshold_single", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("spec", "accept_threshold_acc", lambda v: 0 < v <= 1, "in (0, 1]"),
    *((section, name, lambda v: v >= 1, ">= 1") for section, name in _AT_LEAST_1),
)


def check_ranges(cfg: Config, ctx: CheckContext) -> Config:
    for section, name, ok, want in _RANGES:
        value = getattr(getattr(cfg, section), name)
        if value is not None and not ok(value):
            raise ConfigError(f"{_flag(section, name)} must be {want}, got {value}")
    return cfg


def check_ngram_params(cfg: Config, ctx: CheckContext) -> Config:
    """The NGRAM cache constructor's checks (internals §1.14), with our flag names."""
    s = cfg.spec
    lo_w, hi_w, branch = (s.ngram_min_match_window_size, s.ngram_max_match_window_size,
                          s.ngram_branch_length)
    lo_b, hi_b = s.ngram_min_bfs_breadth, s.ngram_max_bfs_breadth
    f_lo_w, f_hi_w, f_branch, f_lo_b, f_hi_b = (_flag("spec", n) for n in (
        "ngram_min_match_window_size", "ngram_max_match_window_size", "ngram_branch_length",
        "ngram_min_bfs_breadth", "ngram_max_bfs_breadth"))
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
    if s.ngram_match_type.upper() not in NGRAM_MATCH_TYPES:
        raise ConfigError(f"--speculative-ngram-match-type must be BFS or PROB, "
                          f"got {s.ngram_match_type}")
    return _with_spec(cfg, ngram_match_type=s.ngram_match_type.upper())


# ---- things specserve does not do (yet) ---------------------------------------------------

def _check_quantization(flag: str, value: str | None, allowed: tuple[str | None, ...]) -> None:
    if value not in allowed:
        planned = ", ".join(PLANNED_QUANTIZATIONS)
        raise ConfigError(f"{flag} {value} is not supported yet (planned: {planned}); "
                          "GGUF checkpoints are dequantized on load")


def check_unsupported(cfg: Config, ctx: CheckContext) -> Config:
    tp, page = cfg.runner.tp_size, cfg.cache.page_size
    if tp > 1:
        raise ConfigError(f"--tp-size {tp}: tensor parallelism is not supported yet")
    if page > 1:
        raise ConfigError(f"--page-size {page}: page sizes above 1 are not supported yet "
                          "(the KV cache is allocated per token)")
    _check_quantization("--quantization", cfg.model.quantization, (None,))
    # "unquant" is SGLang's way to say "keep the draft unquantized"; that is all we do anyway.
    _check_quantization("--speculative-draft-model-quantization",
                        cfg.spec.draft_model_quantization, (None, "unquant"))
    if cfg.model.device == "cuda" and not ctx.has_cuda():
        raise ConfigError("--device cuda: no CUDA device found")
    for flag, value in (("--speculative-moe-runner-backend", cfg.spec.moe_runner_backend),
                        ("--speculative-moe-a2a-backend", cfg.spec.moe_a2a_backend)):
        if value is not None:
            raise ConfigError(f"{flag} is not supported: specserve serves dense models only")
    if cfg.model.trust_remote_code:
        logger.info("--trust-remote-code is not needed: specserve runs its built-in "
                    "architectures and never executes code from a model repository")
    return cfg


# ---- speculative decoding, at parse time --------------------------------------------------

def normalize_algorithm(cfg: Config, ctx: CheckContext) -> Config:
    algo = cfg.spec.algorithm
    if algo is None:
        return cfg
    algo = algo.upper()
    if algo not in SPEC_ALGORITHMS:
        raise ConfigError(f"--speculative-algorithm must be one of "
                          f"{', '.join(SPEC_ALGORITHMS)}, got {algo}")
    return _with_spec(cfg, algorithm="EAGLE" if algo == "NEXTN" else algo)  # NEXTN is EAGLE's alias


def reject_stray_spec_flags(cfg: Config, ctx: CheckContext) -> Config:
    """A speculative flag without an algorithm is a mistake, not something to ignore."""
    if cfg.spec.algorithm is None:
        for dest, flag in ctx.explicit.items():
            if dest.startswith("speculative_") or dest == "enable_multi_layer_eagle":
                raise ConfigError(f"{flag} requires --speculative-algorithm")
    return cfg


def check_spec_v2(cfg: Config, ctx: CheckContext) -> Config:
    # Checked on the *typed* topk, before auto-tuning, exactly as SGLang does: an omitted topk
    # that auto-resolves to 4 (Llama) is not caught here (resolve_spec_defaults warns instead).
    s = cfg.spec
    if not s.enable_spec_v2 or s.algorithm is None:
        return cfg
    if s.algorithm == "NGRAM":
        raise ConfigError("Spec v2 does not support NGRAM speculative decoding; unset "
                          "SPECSERVE_ENABLE_SPEC_V2 / SGLANG_ENABLE_SPEC_V2")
    if s.eagle_topk is not None and s.eagle_topk > 1:
        raise ConfigError("Spec v2 currently only supports topk = 1 for speculative decoding.")
    return cfg


def check_step_triple(cfg: Config, ctx: CheckContext) -> Config:
    s = cfg.spec
    if s.algorithm in TREE_ALGORITHMS:
        given = [v is not None for v in (s.num_steps, s.eagle_topk, s.num_draft_tokens)]
        if any(given) and not all(given):
            raise ConfigError("set all three of --speculative-num-steps, --speculative-eagle-topk, "
                              "--speculative-num-draft-tokens, or none for auto-tuning")
    return cfg


def check_batch_tree(cfg: Config, ctx: CheckContext) -> Config:
    """--speculative-batch-tree's syntax, and that it is EAGLE's (its step graphs draft it);
    its fit with the main tree is checked once that is known (spec/batch_tree.py)."""
    s = cfg.spec
    if s.batch_tree == AUTO:
        return cfg
    try:
        parse_tree(s.batch_tree)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if s.batch_tree != OFF and s.algorithm not in ("EAGLE", "EAGLE3"):
        raise ConfigError(f"--speculative-batch-tree applies to --speculative-algorithm EAGLE and EAGLE3 "
                          f"only, not {s.algorithm}")
    return cfg


def require_draft_model(cfg: Config, ctx: CheckContext) -> Config:
    s = cfg.spec
    if s.draft_model_path is None and has_shipped_head(cfg.model.model_path, s.algorithm):
        logger.info("No --speculative-draft-model-path: drafting with the %s head shipped for %s",
                    s.algorithm, cfg.model.model_path)
        return cfg
    if s.draft_model_path is None and s.algorithm in ("EAGLE3", "STANDALONE"):
        raise ConfigError(f"--speculative-algorithm {s.algorithm} requires "
                          "--speculative-draft-model-path")
    if s.draft_model_path is None and s.algorithm == "EAGLE":
        # Only models with MTP layers can do without; the engine decides once it reads the model.
        logger.info("No --speculative-draft-model-path: the target's own MTP layers will be "
                    "the draft")
    if s.draft_model_path is not None and s.draft_model_revision is None:
        return _with_spec(cfg, draft_model_revision="main")
    return cfg


_DRAFT_ONLY = ("speculative_draft_model_path", "speculative_draft_model_revision",
               "speculative_draft_load_format", "speculative_token_map",
               "speculative_draft_attention_backend", "speculative_draft_model_quantization")


def warn_ignored_spec_flags(cfg: Config, ctx: CheckContext) -> Config:
    """Flags that do not apply to the chosen algorithm: warned about, never silently dropped."""
    algo = cfg.spec.algorithm
    if algo == "STANDALONE" and cfg.spec.token_map is not None:
        raise ConfigError("--speculative-token-map (FR-Spec) is supported for --speculative-algorithm "
                          "EAGLE only (EAGLE-2 heads and MTP layers)")
    if algo not in (None, "NGRAM", "STANDALONE") and cfg.spec.draft_load_format == "dummy":
        raise ConfigError("--speculative-draft-load-format dummy is supported for --speculative-algorithm "
                          "STANDALONE only (a draft LLM of random weights, for benchmarks)")
    if algo == "EAGLE3" and cfg.spec.token_map is not None:
        logger.warning("--speculative-token-map is ignored for EAGLE3: EAGLE3 models already "
                       "have a draft vocabulary")
    for dest, flag in ctx.explicit.items():
        if algo not in (None, "NGRAM") and dest.startswith("speculative_ngram_"):
            logger.warning("%s is ignored: it applies only to --speculative-algorithm NGRAM", flag)
        if algo == "NGRAM" and dest in _DRAFT_ONLY:
            logger.warning("%s is ignored for NGRAM: n-gram drafting has no draft model", flag)
        if algo == "NGRAM" and dest in ("speculative_eagle_topk", "speculative_num_steps"):
            logger.warning("%s is ignored for NGRAM: its tree comes from the "
                           "--speculative-ngram-* flags", flag)
    return cfg


def warn_lossy_thresholds(cfg: Config, ctx: CheckContext) -> Config:
    for name in ("accept_threshold_single", "accept_threshold_acc"):
        flag, value = _flag("spec", name), getattr(cfg.spec, name)
        if cfg.spec.enabled and value < 1.0:
            logger.warning("%s=%s < 1.0: verification is no longer lossless (outputs no longer "
                           "follow the target model's distribution exactly)", flag, value)
    return cfg


def note_ngram_on_cpu(cfg: Config, ctx: CheckContext) -> Config:
    device = cfg.model.device
    if cfg.spec.algorithm != "NGRAM":  # before has_cuda(): only NGRAM may need to import torch
        return cfg
    if device == "cpu" or (device == "auto" and not ctx.has_cuda()):
        logger.info("NGRAM speculative decoding runs on CPU in specserve "
                    "(SGLang only supports it on CUDA)")
    return cfg


def default_max_running_requests(cfg: Config, ctx: CheckContext) -> Config:
    if not cfg.spec.enabled or cfg.scheduler.max_running_requests is not None:
        return cfg
    logger.warning("Max running requests is reset to 48 for speculative decoding. You can "
                   "override this by explicitly setting --max-running-requests.")
    return replace(cfg, scheduler=replace(cfg.scheduler, max_running_requests=48))


def apply_spec_defaults(cfg: Config, ctx: CheckContext) -> Config:
    return replace(cfg, spec=resolve_spec_defaults(cfg.spec, ctx.architecture))


# ---- speculative decoding, once the architecture is known ---------------------------------

def resolve_spec_defaults(spec: SpecConfig, architecture: str | None) -> SpecConfig:
    """Fill (num_steps, eagle_topk, num_draft_tokens) and apply SGLang's post-rules.

    Idempotent: `parse_config` calls it with whatever architecture it was given (usually None,
    which leaves an omitted EAGLE/EAGLE3 triple unset), and the engine calls it again with the
    target's HF `architectures[0]` once it has read the model config.
    """
    if spec.algorithm is None:
        return spec
    if spec.algorithm == "NGRAM":
        return _ngram_defaults(spec)
    if spec.num_steps is None:
        spec = _auto_choose(spec, architecture)
        if spec.num_steps is None:
            return spec  # EAGLE/EAGLE3 without an architecture yet
    if spec.eagle_topk == 1 and spec.num_draft_tokens != spec.num_steps + 1:
        logger.warning("speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 "
                       "when speculative_eagle_topk == 1")
        spec = replace(spec, num_draft_tokens=spec.num_steps + 1)
    _check_tree_budget(spec)
    return spec


def _auto_choose(spec: SpecConfig, architecture: str | None) -> SpecConfig:
    if spec.algorithm == "STANDALONE":
        steps, topk, n = 3, 1, 4
    elif architecture is None:
        return spec
    elif architecture in WIDE_TREE_ARCHITECTURES:
        steps, topk, n = 5, 4, 8
    else:
        steps, topk, n = 3, 1, 4
    if spec.enable_spec_v2 and topk > 1:
        # SGLang lets this through (its check ran before auto-tuning); we at least say so.
        logger.warning("Spec v2 only supports topk = 1, but auto-tuning chose "
                       "speculative_eagle_topk=%d for %s; set --speculative-eagle-topk 1 "
                       "(with --speculative-num-steps and --speculative-num-draft-tokens)",
                       topk, architecture)
    return replace(spec, num_steps=steps, eagle_topk=topk, num_draft_tokens=n)


def _check_tree_budget(spec: SpecConfig) -> None:
    # EAGLE-2 reranking keeps the N-1 best of topk + (steps-1)*topk^2 candidates (a torch.topk
    # over that pool), so a larger N cannot be filled.
    steps, topk, n = spec.num_steps, spec.eagle_topk, spec.num_draft_tokens
    pool = topk + (steps - 1) * topk * topk
    if n - 1 > pool:
        raise ConfigError(
            f"--speculative-num-draft-tokens {n} is too large for --speculative-num-steps {steps} "
            f"and --speculative-eagle-topk {topk}: the draft tree has topk + (steps-1)*topk^2 = "
            f"{pool} candidates, so num_draft_tokens must be <= {pool + 1}")


def _ngram_defaults(spec: SpecConfig) -> SpecConfig:
    topk = spec.ngram_max_bfs_breadth  # SGLang: speculative_eagle_topk = max_bfs_breadth
    n = spec.num_draft_tokens
    n = spec.ngram_max_match_window_size if n is None else n
    # NGRAM has no draft forwards; steps is only bookkeeping. SGLang 0.5.23 sets N // topk.
    return replace(spec, eagle_topk=topk, num_draft_tokens=n, num_steps=max(1, n // topk))


# SGLang's order where it has one: the Spec v2 topk check runs before auto-tuning.
RULES: tuple[Rule, ...] = (
    normalize_algorithm, reject_stray_spec_flags, check_ranges, check_ngram_params,
    check_unsupported, check_spec_v2, check_step_triple, check_batch_tree, require_draft_model,
    warn_ignored_spec_flags, warn_lossy_thresholds, note_ngram_on_cpu,
    default_max_running_requests, apply_spec_defaults,
)


def check_config(cfg: Config, ctx: CheckContext | None = None) -> Config:
    """Run every rule in order; the first violated one raises ConfigError."""
    ctx = ctx if ctx is not None else CheckContext()
    for rule in RULES:
        cfg = rule(cfg, ctx)
    return cfg
