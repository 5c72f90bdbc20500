"""Typed messages between the front end (HTTP or offline API) and the engine loop.

Small picklable dataclasses: they cross a process boundary (multiprocessing pipe) in the
server and stay in-process for the offline `Engine`. Deltas cross the pipe from the engine
as `TokenOut.packed` tuples (`pack_outs` / `unpack_outs`), a list per message. Nothing here
touches torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specserve.core.sampling_params import SamplingParams


@dataclass
class GenerateReq:
    rid: str
    input_ids: list[int]
    params: SamplingParams


@dataclass
class AbortReq:
    rid: str


@dataclass
class ControlReq:
    """An out-of-band question or command: 'flush_cache', 'server_info', 'metrics'."""

    op: str
    token: int = 0


@dataclass
class ControlOut:
    token: int
    result: Any


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class TokenOut:
    """What one request produced since its last TokenOut (a streaming delta).

    `text` is the newly *releasable* detokenized text: text that could still turn into a
    stop string is held back until it cannot. When `finished` is set, `finish_reason` is
    {"type": "stop", "matched": str | int | None} or {"type": "length"} or
    {"type": "abort", "message": str}.
    """

    rid: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: dict | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # spec_verify_ct, spec_accept_length, ...

    def packed(self) -> tuple:
        """This delta as a plain tuple: what crosses the engine's pipe (a list of tuples
        pickles faster than a list of dataclasses)."""
        return (self.rid, self.token_ids, self.text, self.finished, self.finish_reason, self.prompt_tokens,
                self.completion_tokens, self.cached_tokens, self.logprobs or None, self.meta or None)

    @staticmethod
    def unpacked(row: tuple) -> TokenOut:
        """The inverse of `packed`."""
        return TokenOut(row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7], row[8] or [], row[9] or {})


def pack_outs(outs: list[TokenOut]) -> list[tuple]:
    return [o.packed() for o in outs]


def unpack_outs(rows: list[tuple]) -> list[TokenOut]:
    return [TokenOut.unpacked(r) for r in rows]
