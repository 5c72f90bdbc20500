"""Server-sent events: the `data: {...}\\n\\n` framing, the stream loop, and a response that
always cleans up.

Owns the streaming side of every endpoint: `sse_stream` turns a started `FanOut` plus a
`StreamFormatter` (which knows the endpoint's chunk shapes) into SSE text ending in
`data: [DONE]`; an error after the headers went out becomes an `{"error": ...}` event, since
the status line can no longer change. `SSEResponse` guarantees `FanOut.close()` runs however
the response ends (normal end, client disconnect, server error), so a departed client's
engine requests are aborted.
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from specserve.core.messages import TokenOut
from specserve.server.fanout import FanOut, abort_error, to_api_error

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse(payload: str | dict[str, Any]) -> str:
    """Frame one event; `payload` is a JSON string or a dict to serialize."""
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {text}\n\n"


class StreamFormatter(Protocol):
    """Endpoint-specific chunk shapes; each method returns JSON payloads to send, in order."""

    def start(self) -> list[str]: ...

    def delta(self, index: int, out: TokenOut) -> list[str]: ...

    def end(self) -> list[str]: ...


async def sse_stream(
    fan: FanOut, first: tuple[int, TokenOut] | None, fmt: StreamFormatter
) -> AsyncIterator[str]:
    """Yield the SSE events of a whole response. `first` is the delta already awaited (so that
    a request the engine rejects got a 4xx status instead of a 200 stream).

    Every write holds what is ready: the opening events with the first deltas, the deltas
    already queued together (a loop that fell behind catches up with fewer sends, instead
    of one a token), and the closing events with `[DONE]`."""
    head = tail = ""
    try:
        head = "".join(map(sse, fmt.start()))
        item = first
        while item is not None:
            payloads: list[str] = []
            err = None
            while item is not None:
                index, out = item
                if out.finished and (err := abort_error(out.finish_reason)) is not None:
                    break
                payloads += fmt.delta(index, out)
                item = fan.poll()
            text, head = head + "".join(map(sse, payloads)), ""
            if text:
                yield text
            if err is not None:
                raise err
            item = await fan.next()
        tail = head + "".join(map(sse, fmt.end()))
    except Exception as exc:  # noqa: BLE001 - the status is sent; report in-band and end cleanly
        tail = head + sse(to_api_error(exc).body())  # an unexpected one is logged by to_api_error
    finally:
        await fan.close()
    yield tail + DONE


class SSEResponse(StreamingResponse):
    """A text/event-stream response that runs `on_close` when it ends, whatever ends it.

    Starlette cancels the body iterator on a disconnect without closing it, and never starts
    it at all if the client left before the first byte; `on_close` covers both.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()  # type: ignore[attr-defined]
                await self._on_close()

