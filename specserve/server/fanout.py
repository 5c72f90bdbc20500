"""Run several engine requests for one HTTP request, and stop them when the client leaves.

Owns the lifetime of engine streams on the HTTP side: `FanOut` pumps one
`client.generate(...)` async generator per choice into one queue, in arrival order, and its
`close()` cancels the pumps, which closes the generators, which (per the `EngineClient`
contract) aborts the engine requests and frees their KV memory. `until_disconnected` races
any awaitable against the client hanging up. It knows nothing about response formats.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
from starlette.requests import Request

from specserve.core.messages import GenerateReq, TokenLogprob, TokenOut
from specserve.engine.protocol import DuplicateRequestId, EngineClient, ShuttingDown
from specserve.server.errors import APIError, internal_error

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


class FanOut:
    """One engine stream per choice, merged. `next()` -> (choice index, delta) or None at the end.

    Invariant: after `close()` no pump task is running, so no engine request it started can
    outlive the HTTP request. A pump keeps iterating after the `finished` delta instead of
    breaking, so a finished request's generator ends on its own and is never "aborted".
    """

    def __init__(self, client: EngineClient, reqs: list[GenerateReq]):
        self.client = client
        self.reqs = reqs
        self._queue: asyncio.Queue[tuple[int, TokenOut | BaseException]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._open = len(reqs)

    def start(self) -> FanOut:
        self._tasks = [asyncio.create_task(self._pump(i, r)) for i, r in enumerate(self.reqs)]
        return self

    async def _pump(self, index: int, req: GenerateReq) -> None:
        stream = self.client.generate(req)
        finished = False
        try:
            async for out in stream:
                finished = finished or out.finished
                self._queue.put_nowait((index, out))
            if not finished:
                raise RuntimeError(f"engine stream for {req.rid} ended without a finished output")
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which decides the status
            self._queue.put_nowait((index, exc))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def next(self) -> tuple[int, TokenOut] | None:
        """The next delta of any choice; raises what an engine stream raised (ValueError -> 400)."""
        if self._open == 0:
            return None
        return self._take(await self._queue.get())

    def poll(self) -> tuple[int, TokenOut] | None:
        """The next delta if one is queued already, else None (as at the end); raises as `next`."""
        if self._open == 0 or self._queue.empty():
            return None
        return self._take(self._queue.get_nowait())

    def _take(self, queued: tuple[int, TokenOut | BaseException]) -> tuple[int, TokenOut]:
        index, item = queued
        if isinstance(item, BaseException):
            if not isinstance(item, (ValueError, APIError)) and not self.client.is_alive():
                raise APIError(503, "The engine is not running")
            raise to_api_error(item)
        if item.finished:
            self._open -= 1
        return index, item

    async def close(self) -> None:
        """Cancel unfinished pumps and wait for their generators to close. Idempotent.

        Shielded: this runs in `finally` blocks of cancelled tasks (client disconnects), where
        anyio would otherwise cancel the await again and skip the cleanup.
        """
        with anyio.CancelScope(shield=True):
            for task in self._tasks:
                if not task.done():
                    task.cancel()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)


@dataclass
class ChoiceState:
    """Everything one engine request has produced so far (the non-streaming accumulator)."""

    index: int
    pieces: list[str] = field(default_factory=list)  # joined on demand: no quadratic +=
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: dict | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, out: TokenOut) -> None:
        if out.text:
            self.pieces.append(out.text)
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = out.completion_tokens or len(self.token_ids)
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        self.meta.update(out.meta)
        if out.finished:
            self.finish_reason = out.finish_reason or {"type": "stop"}


def finish_reason_str(reason: dict | None) -> str | None:
    """The engine's {"type": ...} as OpenAI's finish_reason string."""
    return None if reason is None else str(reason.get("type", "stop"))


def abort_error(reason: dict | None) -> APIError | None:
    """An engine-side abort (not a client disconnect) surfaces as an error, not a silent "abort"."""
    if not reason or reason.get("type") != "abort":
        return None
    status = int(reason.get("status_code", 500))
    return APIError(status, str(reason.get("message") or "The request was aborted by the engine"))


async def collect(fan: FanOut) -> list[ChoiceState]:
    """Drain every stream of `fan` into one ChoiceState per request; raises on engine aborts."""
    states = [ChoiceState(i) for i in range(len(fan.reqs))]
    while (item := await fan.next()) is not None:
        index, out = item
        states[index].add(out)
    for state in states:
        if (err := abort_error(state.finish_reason)) is not None:
            raise err
    return states


def to_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ShuttingDown):
        return APIError(503, str(exc))
    if isinstance(exc, DuplicateRequestId):
        return APIError(409, str(exc), "rid")
    if isinstance(exc, ValueError):  # the engine refused the request before queueing it
        return APIError(400, str(exc))
    return internal_error("the engine stream failed", exc)


async def _wait_disconnect(request: Request) -> None:
    # The body has been read already, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work_task.done():
            work_task.cancel()
    if not work_task.done() or work_task.cancelled():
        raise ClientDisconnected()
    return work_task.result()
