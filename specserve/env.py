"""Typed access to the environment variables specserve reads.

This file owns the variable names, their SGLang aliases and how their values are parsed. It
does not know what the values are used for: `specserve/args.py` copies them into the frozen
`Config` once at start-up, and nothing else in specserve should read `os.environ` for these.

Each variable has a `SPECSERVE_` name and the `SGLANG_` spelling of the same variable as an
alias, so existing SGLang launch scripts keep working. The `SPECSERVE_` name wins when both
are set. Booleans accept what SGLang accepts (case-insensitive "1"/"true"/"yes"/"y" and
"0"/"false"/"no"/"n", plus "on"/"off"); anything else is a `ValueError` naming the variable,
because a typo such as `SGLANG_ENABLE_SPEC_V2=ture` should not silently mean False.
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
