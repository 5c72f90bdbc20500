"""Speculation's counters: the engine-wide accept length, and each request's, in SGLang's names.

`SpecStats` feeds the decode log line (`accept len` per window) and the server info and
metrics (since start). `record_request` keeps a request's `meta_info` counters: only
verifies that carried drafts count (`spec_verify_ct`); steps the governor ran plainly and
root-only trees are counted apart (`spec_plain_ct`), so the accept length is that of
speculation.
"""
from __future__ import annotations

from typing import Any


class SpecStats:
    """Accepted-token counters: per log window (log line) and since start (server info)."""

    def __init__(self) -> None:
        self.window_verifies = self.window_tokens = 0
        self.total_verifies = self.total_tokens = 0

    def add(self, verifies: int, tokens: int) -> None:
        self.window_verifies += verifies
        self.window_tokens += tokens
        self.total_verifies += verifies
        self.total_tokens += tokens

    def take_window(self) -> float | None:
        """Mean tokens committed per request per verify since the last call (SGLang's accept len)."""
        if not self.window_verifies:
            return None
        value = self.window_tokens / self.window_verifies
        self.window_verifies = self.window_tokens = 0
        return value

    @property
    def avg_accept_length(self) -> float | None:
        return self.total_tokens / self.total_verifies if self.total_verifies else None


def record_request(meta: dict[str, Any], committed: int, drafted: bool, nodes: int) -> None:
    """One step's tokens for a request: `committed` tokens from a verify of `nodes` nodes
    (root included) when `drafted`, else one plain step."""
    if not drafted:
        meta["spec_plain_ct"] = meta.get("spec_plain_ct", 0) + 1
        return
    meta["spec_verify_ct"] = meta.get("spec_verify_ct", 0) + 1
    meta["spec_accept_token_num"] = meta.get("spec_accept_token_num", 0) + committed - 1
    meta["spec_draft_token_num"] = meta.get("spec_draft_token_num", 0) + nodes - 1
    meta["spec_accept_length"] = (meta["spec_accept_token_num"] + meta["spec_verify_ct"]) / meta["spec_verify_ct"]
    meta["spec_accept_rate"] = meta["spec_accept_token_num"] / max(meta["spec_draft_token_num"], 1)
