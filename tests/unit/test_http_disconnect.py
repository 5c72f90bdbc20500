"""A client that hangs up aborts its requests: the HTTP layer against the fake engine of
test_http.py, driven through raw ASGI so the client can really disconnect mid-response."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from specserve.server.http import build_app
from tests.unit.test_http import FakeEngineClient, chat


async def _call_and_hang_up(app: Any, path: str, body: dict, after_chunks: int | None, after_s: float = 0.0) -> list[dict]:
    """POST `body`; disconnect after `after_chunks` non-empty body chunks (or after `after_s`)."""
    hang_up = asyncio.Event()
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        if after_chunks is not None and len(chunks) >= after_chunks:
            hang_up.set()

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1), "server": ("t", 80),
    }
    if after_chunks is None:
        asyncio.get_running_loop().call_later(after_s, hang_up.set)
    await asyncio.wait_for(app(scope, receive, send), 5)
    return sent


@pytest.mark.parametrize("n", [1, 3])
def test_stream_disconnect_aborts(n: int) -> None:
    fake = FakeEngineClient(delay=0.005)
    body = chat(max_tokens=40, n=n, stream=True)
    sent = asyncio.run(_call_and_hang_up(build_app(fake), "/v1/chat/completions", body, after_chunks=n + 2))
    assert sent[0]["status"] == 200
    assert sorted(fake.aborted) == sorted(r.rid for r in fake.submitted) and len(fake.aborted) == n
    assert fake.running == 0


def test_non_streaming_disconnect_aborts() -> None:
    fake = FakeEngineClient(delay=0.005)
    asyncio.run(_call_and_hang_up(build_app(fake), "/v1/completions", {"prompt": "a", "max_tokens": 40, "n": 2}, None, 0.05))
    assert len(fake.aborted) == 2 and fake.running == 0
