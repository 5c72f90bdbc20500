"""The front end's view of an engine: what it starts from, and what the HTTP layer may call.

`EngineStart` is what start-up resolved before any weights load (preflight.py); it crosses
into the engine process. `EngineClient` is implemented by `engine/link.py` (pipes to engines
running in other processes; `engine/client.py` is the launcher's, which owns them) and by
test fakes. The HTTP layer depends on this protocol
only, never on the scheduler, so the two can be tested apart.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from specserve.core.config import Config
from specserve.core.messages import GenerateReq, TokenOut
from specserve.engine.speculation import SpecPlan


class DuplicateRequestId(ValueError):
    """A request id that is already in flight: refused, so that no two requests share a
    stream (the HTTP layer answers 409)."""


class ShuttingDown(RuntimeError):
    """The server is shutting down and admits no new request (the HTTP layer answers 503)."""


@dataclass(frozen=True)
class EngineStart:
    """Everything an engine is built from, settled by start-up (picklable)."""

    config: Config  # its speculative part resolved (draft directory, tree)
    model_dir: Path  # the target's local Hugging Face-layout directory
    tokenizer_dir: Path  # the tokenizer's (the model's own unless --tokenizer-path)
    spec: SpecPlan | None = None  # the speculative set-up (spec/registry.py), None without


@dataclass(frozen=True)
class RankPlace:
    """Where one engine process runs: its tensor-parallel rank and device (picklable)."""

    tp_size: int = 1
    rank: int = 0
    dist_addr: str = ""  # "host:port" where the group meets (tp_size > 1)
    gpu: int | None = None  # the GPU index (of those visible); None on the CPU
    host_procs: int = 1  # engine processes on this host, all replicas counted (CPU threads are shared)


@dataclass(frozen=True)
class ModelInfo:
    served_model_name: str
    context_length: int  # prompt + completion tokens must fit in this
    vocab_size: int
    max_running_requests: int
    max_total_tokens: int


class EngineClient(Protocol):
    config: Config
    info: ModelInfo
    tokenizer: Any  # specserve.tokenizer.tokenizer.Tokenizer

    def generate(self, req: GenerateReq) -> AsyncIterator[TokenOut]:
        """Submit `req` and yield its deltas until one has `finished=True`.

        If the consumer stops early (the async generator is closed or its task cancelled,
        e.g. on a client disconnect), the request is aborted and its KV memory freed.
        Raises ValueError before submitting if the request cannot be served (prompt too
        long for the context, bad sampling params): the caller maps it to a 4xx; its
        subclass DuplicateRequestId when `req.rid` is already in flight (nothing else is
        touched: the request with that id keeps its stream).
        """
        ...

    async def abort(self, rid: str) -> None: ...

    async def control(self, op: str) -> Any:
        """'server_info' -> dict, 'metrics' -> dict of counters/gauges, 'flush_cache' -> bool."""
        ...

    def is_alive(self) -> bool: ...
