"""The front end's view of an engine: what the HTTP layer may call.

`EngineClient` is implemented by `engine/client.py` (an engine running in a child
process) and by test fakes. The HTTP layer depends on this protocol only, never on the
scheduler, so the two can be tested apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

from specserve.config import Config
from specserve.engine.messages import GenerateReq, TokenOut


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
    tokenizer: Any  # specserve.server.tokenizer.Tokenizer

    def generate(self, req: GenerateReq) -> AsyncIterator[TokenOut]:
        """Submit `req` and yield its deltas until one has `finished=True`.

        If the consumer stops early (the async generator is closed or its task cancelled,
        e.g. on a client disconnect), the request is aborted and its KV memory freed.
        Raises ValueError before submitting if the request cannot be served (prompt too
        long for the context, bad sampling params): the caller maps it to a 4xx.
        """
        ...

    async def abort(self, rid: str) -> None: ...

    async def control(self, op: str) -> Any:
        """'server_info' -> dict, 'metrics' -> dict of counters/gauges, 'flush_cache' -> bool."""
        ...

    def is_alive(self) -> bool: ...
