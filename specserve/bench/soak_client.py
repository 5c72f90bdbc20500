"""Sending one soak `Plan` over HTTP and recording what came back.

Owns the client side of a soak request: the request (streamed or not), reading each route's
answer shape into per-choice texts and finish reasons, hanging up on purpose where the plan
says so, and turning every way a request can end (a status, an in-band SSE error, a broken
connection) into one `Outcome`. It judges nothing: soak_checks.py does.

Finish reasons are normalized to strings: OpenAI's `finish_reason`, /generate's
`meta_info.finish_reason.type`. Completion tokens are what the answer reports (usage,
meta_info); an OpenAI stream without `include_usage` (or hung up on) counts its text chunks.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from specserve.bench.soak_plan import CHAT, GENERATE, Plan


@dataclass
class Outcome:
    """How one request ended."""

    route: str
    kind: str
    stream: bool
    reference: int | None = None
    choices: int = 1  # choices a whole answer carries
    status: int | None = None  # None: no status line came (hung up first, or the connection broke)
    closed_early: bool = False  # the client hung up on purpose before the answer ended
    texts: dict[int, str] = field(default_factory=dict)  # choice index -> text
    finish: dict[int, str | None] = field(default_factory=dict)  # choice index -> finish reason
    error: dict[str, Any] | None = None  # the error body (status >= 400 or an in-band SSE error)
    transport_error: str | None = None  # the connection failed (not on purpose)
    completion_tokens: int = 0
    seconds: float = 0.0

    @property
    def error_code(self) -> int | None:
        """The status an error reports: the HTTP status, or an in-band error's `code`."""
        if self.error is None:
            return None
        code = self.error.get("code")
        return code if isinstance(code, int) else self.status


def _error_of(payload: Any) -> dict[str, Any] | None:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return payload["error"]
    return None


def read_choices(route: str, payload: Any, out: Outcome, streamed: bool) -> None:
    """Fold one JSON answer (a whole response or one SSE event) into `out`."""
    if route == GENERATE:
        items = payload if isinstance(payload, list) else [payload]
        for k, item in enumerate(items):
            index = int(item.get("index", k))
            out.texts[index] = item.get("text", "")  # cumulative, streamed or not
            meta = item.get("meta_info") or {}
            reason = meta.get("finish_reason")
            if reason is not None:
                out.finish[index] = reason.get("type") if isinstance(reason, dict) else str(reason)
                out.completion_tokens += int(meta.get("completion_tokens") or 0)
        return
    for choice in payload.get("choices") or []:
        index = int(choice.get("index", 0))
        if route == CHAT:
            piece = (choice.get("delta") if streamed else choice.get("message")) or {}
            text = piece.get("content") or ""
        else:
            text = choice.get("text") or ""
        out.texts[index] = out.texts.get(index, "") + text if streamed else text
        out.completion_tokens += bool(streamed and text)  # a chunk ~ a token, until usage says
        if choice.get("finish_reason") is not None:
            out.finish[index] = choice["finish_reason"]
    usage = payload.get("usage")
    if isinstance(usage, dict):
        out.completion_tokens = int(usage.get("completion_tokens") or 0)  # exact: replaces the count


async def _read_stream(resp: httpx.Response, plan: Plan, out: Outcome, on_event: Callable[[], None] | None) -> None:
    events, done = 0, False
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        payload = json.loads(line[6:])
        if (err := _error_of(payload)) is not None:
            out.error = err
            continue
        read_choices(plan.route, payload, out, streamed=True)
        events += 1
        if on_event is not None:
            on_event()
        if plan.close_after_events is not None and events >= plan.close_after_events \
                and len(out.finish) < plan.choices:
            out.closed_early = True
            return  # leaving the `async with` closes the connection: the server sees a hang-up
    if not done:
        out.transport_error = "the stream ended without data: [DONE]"


async def _send(http: httpx.AsyncClient, plan: Plan, out: Outcome, on_event: Callable[[], None] | None) -> None:
    if plan.stream:
        async with http.stream("POST", plan.route, json=plan.body) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                out.error = _error_of(json.loads(await resp.aread())) or {"message": "no error body"}
                return
            await _read_stream(resp, plan, out, on_event)
        return
    resp = await http.post(plan.route, json=plan.body)
    out.status = resp.status_code
    payload = resp.json()
    if resp.status_code != 200:
        out.error = _error_of(payload) or {"message": "no error body"}
        return
    read_choices(plan.route, payload, out, streamed=False)


async def run_plan(http: httpx.AsyncClient, plan: Plan, on_event: Callable[[], None] | None = None) -> Outcome:
    """Send `plan`; `on_event` is called after each streamed event (a duplicate pair's signal)."""
    out = Outcome(plan.route, plan.kind, plan.stream, plan.reference, plan.choices)
    start = time.perf_counter()
    try:
        if plan.close_after_s is None:
            await _send(http, plan, out, on_event)
        else:
            await asyncio.wait_for(_send(http, plan, out, on_event), plan.close_after_s)
    except asyncio.TimeoutError:
        out.closed_early = True  # wait_for cancelled the request: the connection is closed
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.transport_error = f"{type(exc).__name__}: {exc}"
    out.seconds = time.perf_counter() - start
    return out


async def run_pair(http: httpx.AsyncClient, first: Plan, second: Plan) -> list[Outcome]:
    """A duplicate-rid pair: `second` goes out once `first` streamed its first event."""
    started = asyncio.Event()
    task = asyncio.create_task(run_plan(http, first, started.set))
    waiter = asyncio.create_task(started.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    out_second = await run_plan(http, second)
    return [await task, out_second]
