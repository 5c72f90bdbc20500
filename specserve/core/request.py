"""Req: one generation request as the scheduler sees it.

Token bookkeeping invariant: `all_ids = prompt + output`; the KV of all_ids[:kv_len] is
in the cache (table row `row`). A request in decode has kv_len == len(all_ids) - 1: its
last token is the next forward's input. A prefilling request has kv_len < len(all_ids)
and may need several chunks. Text state (detokenizer, stop strings) lives here too, so a
retracted request resumes streaming exactly where it stopped.
"""
from __future__ import annotations

import time
from typing import Any

from specserve.core.messages import TokenLogprob
from specserve.core.sampling_params import SamplingParams


class Req:
    def __init__(self, rid: str, prompt_ids: list[int], params: SamplingParams, seed: int,
                 detok: Any, stops: Any) -> None:
        self.rid = rid
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.seed = seed
        self.detok = detok  # IncrementalDetokenizer
        self.stops = stops  # StopChecker
        # KV state (see the module docstring)
        self.table_row: int | None = None  # while it holds KV memory (KVManager.admit .. release)
        self.kv_len = 0
        self.cached_len = 0  # prefix slots borrowed from the prefix cache (locked there)
        self.cache_node: Any = None
        # results not yet sent to the front end
        self.pending_ids: list[int] = []
        self.pending_text = ""
        self.pending_logprobs: list[TokenLogprob] = []
        self.finish_reason: dict | None = None
        self.cached_tokens = 0  # prompt tokens served from the prefix cache (usage stats)
        self.created = time.monotonic()
        self.meta: dict = {}
        self.grammar: Any = None  # grammar.GrammarMatcher when params.constraint is set

    @property
    def row(self) -> int:
        """The request's row of the request-to-token table, while it holds KV memory."""
        assert self.table_row is not None, f"request {self.rid} holds no table row"
        return self.table_row

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_id(self) -> int:
        """all_ids[-1] without building all_ids (a decode step's input)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefill_remaining(self) -> int:
        """Tokens whose KV must still be computed before the next token can be sampled."""
        return self.seq_len - self.kv_len

    @property
    def in_decode(self) -> bool:
        return self.table_row is not None and self.kv_len == self.seq_len - 1

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_new_tokens if self.params.max_new_tokens is not None else 1 << 30

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.max_new_tokens - len(self.output_ids))

    def __repr__(self) -> str:
        return f"Req({self.rid}, prompt={len(self.prompt_ids)}, out={len(self.output_ids)}, kv={self.kv_len})"
