"""Typed access to every environment variable specserve reads; nothing else reads os.environ.

This file owns the variable names, their SGLang aliases and how their values are parsed. It
does not know what the values are used for. Two kinds:
  * the user-facing pair SGLang documents (SPECSERVE_ENABLE_SPEC_V2 and
    SPECSERVE_NGRAM_FORCE_GREEDY_VERIFY, with their `SGLANG_` spellings as aliases, the
    `SPECSERVE_` name winning when both are set): `specserve/args.py` copies them into the
    frozen Config once at start-up. Booleans accept what SGLang accepts (case-insensitive
    "1"/"true"/"yes"/"y" and "0"/"false"/"no"/"n", plus "on"/"off"); anything else is a
    `ValueError` naming the variable, because a typo such as `SGLANG_ENABLE_SPEC_V2=ture`
    should not silently mean False;
  * developer switches (kernel paths, the model cache, torch.compile's mode), read when
    they are used, so a test can set them per case.
"""
from __future__ import annotations

import os

_TRUTHY = frozenset({"1", "true", "yes", "y", "on"})
_FALSY = frozenset({"0", "false", "no", "n", "off"})


def parse_bool(name: str, raw: str) -> bool:
    """Parse one boolean environment value; `name` only appears in the error message."""
    value = raw.strip().lower()
    if value in _TRUTHY:
        return True
    if value in _FALSY:
        return False
    raise ValueError(
        f"invalid value for environment variable {name}: {raw!r} "
        "(expected 1/0, true/false, yes/no or on/off)"
    )


def env_bool(name: str, *aliases: str, default: bool = False) -> bool:
    """The first of `name`, `*aliases` that is set (and not empty), parsed; else `default`.

    An empty value counts as unset, so `VAR= python -m specserve.launch_server` keeps the
    default instead of failing.
    """
    for var in (name, *aliases):
        raw = os.environ.get(var)
        if raw is not None and raw.strip():
            return parse_bool(var, raw)
    return default


def spec_v2_enabled() -> bool:
    """SPECSERVE_ENABLE_SPEC_V2 (alias SGLANG_ENABLE_SPEC_V2): the overlap spec worker."""
    return env_bool("SPECSERVE_ENABLE_SPEC_V2", "SGLANG_ENABLE_SPEC_V2")


def ngram_force_greedy_verify() -> bool:
    """SPECSERVE_NGRAM_FORCE_GREEDY_VERIFY (alias SGLANG_NGRAM_FORCE_GREEDY_VERIFY)."""
    return env_bool("SPECSERVE_NGRAM_FORCE_GREEDY_VERIFY", "SGLANG_NGRAM_FORCE_GREEDY_VERIFY")


# ---- developer switches: read at use, "0" turns a default-on switch off ----------------------

def _on(name: str) -> bool:
    return os.environ.get(name, "1") != "0"


def fused_kernels_override() -> bool | None:
    """SPECSERVE_FUSED_KERNELS=0/1 forces the fused Triton kernels off or on; unset: automatic."""
    raw = os.environ.get("SPECSERVE_FUSED_KERNELS", "").strip()
    return None if raw == "" else raw not in ("0", "false", "off")


def pdl_allowed() -> bool:
    """SPECSERVE_PDL=0 turns programmatic dependent launch off (kernels/__init__.py)."""
    return _on("SPECSERVE_PDL")


def tma_allowed() -> bool:
    """SPECSERVE_TMA=0 keeps the few-token kernel off TMA descriptors (kernels/skinny.py)."""
    return _on("SPECSERVE_TMA")


def skinny_allowed() -> bool:
    """SPECSERVE_SKINNY=0 sends few-token linear layers to cuBLAS (kernels/skinny.py)."""
    return _on("SPECSERVE_SKINNY")


def l2_prefetch_allowed() -> bool:
    """SPECSERVE_L2_PREFETCH=0 turns the kernels' L2 weight prefetch off (kernels/pdl.py)."""
    return _on("SPECSERVE_L2_PREFETCH")


def split_merge_allowed() -> bool:
    """SPECSERVE_SPLIT_MERGE=1 merges attention's key splits in the splitting launch itself
    instead of in a launch of their own (attention/split_merge.py; off by default: it
    measured slower)."""
    return os.environ.get("SPECSERVE_SPLIT_MERGE", "0") == "1"


def ngram_on_device() -> bool:
    """SPECSERVE_NGRAM_ON_DEVICE=1 lets NGRAM draft on the device where the worker pipelines
    (spec/ngram/lookup.py; off by default: on a real model it has not yet measured faster
    than the trie's host drafts)."""
    return os.environ.get("SPECSERVE_NGRAM_ON_DEVICE", "0") == "1"


def torch_compile_mode() -> str:
    """SPECSERVE_TORCH_COMPILE_MODE: inductor's mode for --enable-torch-compile (default "default")."""
    return os.environ.get("SPECSERVE_TORCH_COMPILE_MODE", "default")


def tp_all_reduce() -> str:
    """SPECSERVE_TP_ALLREDUCE: "auto" (symmetric-memory all-reduce for small tensors on GPUs,
    NCCL for the rest) or "nccl" (NCCL always; engine/tp_group.py)."""
    return os.environ.get("SPECSERVE_TP_ALLREDUCE", "auto").strip().lower() or "auto"


def cache_dir() -> str | None:
    """SPECSERVE_CACHE_DIR: where fetched and converted models live (default ~/.cache/specserve)."""
    return os.environ.get("SPECSERVE_CACHE_DIR") or None


def c_compiler() -> str:
    """CC: the C compiler that builds kernels/cpu_quant.c (default cc)."""
    return os.environ.get("CC") or "cc"
