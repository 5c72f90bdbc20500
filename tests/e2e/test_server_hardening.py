"""End-to-end: clients cannot reach each other's requests or stall the server (issue 52).

On the real server and engine: a second request with a rid that is in flight is a 409
while the first streams on, and the first's answer is exactly what it answers alone (no
cross-talk); the rid is free again once the first ends. A 10 MB prompt is a 400 at once,
and /health and another client are answered while it is being refused.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.server_utils import launched_server

pytestmark = [pytest.mark.slow, pytest.mark.serial]


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> Iterator[str]:
    with launched_server([], tmp_path_factory.mktemp("hardening") / "server.log") as base:
        yield base


def _gen(text: str, **extra) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}, **extra}


async def _stream_text(client: httpx.AsyncClient, url: str, body: dict, started: asyncio.Event) -> str:
    last = None
    async with client.stream("POST", f"{url}/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                last = json.loads(line.removeprefix("data: "))
                started.set()
    assert last is not None and last["meta_info"]["finish_reason"]["type"] == "length", last
    return last["text"]


def test_a_rid_in_flight_is_refused_and_never_shared(url):
    async def run() -> tuple[str, list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=300) as client:
            started = asyncio.Event()
            first = asyncio.create_task(_stream_text(client, url, _gen("Count to ten.", rid="dup"), started))
            await asyncio.wait_for(started.wait(), 120)
            refused = [await client.post(f"{url}/generate", json=_gen("Name a fruit.", rid="dup")),
                       await client.post(f"{url}/generate", json=_gen(["x", "y"], rid=["other", "dup"]))]
            return await first, refused

    text, refused = asyncio.run(run())
    for r in refused:
        assert r.status_code == 409 and r.json()["error"]["param"] == "rid", r.text
    alone = httpx.post(f"{url}/generate", json=_gen("Count to ten."), timeout=300).json()
    assert text == alone["text"]  # only its own tokens
    again = httpx.post(f"{url}/generate", json=_gen("Name a fruit.", rid="dup"), timeout=300)
    assert again.status_code == 200 and again.json()["meta_info"]["id"] == "dup"


def test_a_huge_prompt_is_refused_at_once_and_stalls_no_one(url):
    async def run() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=300) as client:
            huge = asyncio.create_task(client.post(f"{url}/v1/completions",
                                                   json={"prompt": "hello " * 1_700_000, "max_tokens": 1}))
            others = [await client.get(f"{url}/health", timeout=5) for _ in range(3)]
            others.append(await client.post(f"{url}/generate", json=_gen("Hi"), timeout=120))
            return await huge, others

    huge, others = asyncio.run(run())
    assert huge.status_code == 400 and "maximum context length" in huge.json()["error"]["message"], huge.text
    assert huge.json()["error"]["param"] == "prompt"
    assert all(r.status_code == 200 for r in others)
