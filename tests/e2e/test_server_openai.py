"""End-to-end: the real server (`python -m specserve.launch_server`, default model on CPU)
driven with the official `openai` client and raw `httpx`.

Covers what a user of the OpenAI API or of SGLang's native API does: chat and completions,
streaming, stop strings, concurrency, every bad input of DESIGN 1.3 (status and error body),
a client that hangs up mid-stream (the running-request gauge must return to 0), `/generate`,
`/v1/models`, `/health`, `/flush_cache`. One server per module; the first start may fetch and
convert the model, hence the long health timeout.

Environment: SPECSERVE_E2E_ARGS adds launch flags (e.g. speculative ones, split like a shell
would); SPECSERVE_E2E_URL skips the launch and tests a server that is already running.
"""
from __future__ import annotations

import asyncio
import os
import shlex
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.server_utils import launched_server

pytestmark = pytest.mark.slow

PROMPT = "List 3 countries and their capitals."


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if os.environ.get("SPECSERVE_E2E_URL"):
        yield os.environ["SPECSERVE_E2E_URL"].rstrip("/")
        return
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with launched_server(shlex.split(os.environ.get("SPECSERVE_E2E_ARGS", "")), log_path) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def model_info(base_url: str) -> dict[str, Any]:
    return httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]


def _messages(text: str = PROMPT) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _running(base_url: str) -> float:
    """Running + queued requests, from the Prometheus gauges the engine reports."""
    total = 0.0
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("specserve:num_running_reqs", "specserve:num_queue_reqs"):
            total += float(value)
    return total


def _wait_idle(base_url: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _running(base_url) > 0:
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.2)


# -- OpenAI client ----------------------------------------------------------------------------
def test_models_and_health(base_url: str, client: openai.OpenAI, model_info: dict[str, Any]) -> None:
    assert [m.id for m in client.models.list().data] == [model_info["id"]]
    assert model_info["max_model_len"] > 0
    assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{base_url}/health_generate", timeout=60).status_code == 200
    info = httpx.get(f"{base_url}/get_server_info", timeout=10)
    assert info.status_code == 200 and isinstance(info.json(), dict)
    assert "specserve:num_running_reqs" in httpx.get(f"{base_url}/metrics", timeout=10).text


def test_chat_non_streaming(client: openai.OpenAI, model_info: dict[str, Any]) -> None:
    r = client.chat.completions.create(model=model_info["id"], messages=_messages(), temperature=0, max_tokens=48)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming(client: openai.OpenAI, model_info: dict[str, Any]) -> None:
    stream = client.chat.completions.create(
        model=model_info["id"], messages=_messages(), temperature=0, max_tokens=48, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content.strip() and finishes in (["stop"], ["length"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_chat_n_and_logprobs(client: openai.OpenAI, model_info: dict[str, Any]) -> None:
    r = client.chat.completions.create(
        model=model_info["id"], messages=_messages(), max_tokens=8, n=2, seed=1, logprobs=True, top_logprobs=2
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    for choice in r.choices:
        tokens = choice.logprobs.content
        assert tokens and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)


def test_completions(client: openai.OpenAI, model_info: dict[str, Any]) -> None:
    r = client.completions.create(model=model_info["id"], prompt="The capital of France is", temperature=0, max_tokens=8)
    assert r.choices[0].text and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0


def _pick_stop(text: str) -> str:
    """A stop string the unstopped greedy reply contains, away from its start."""
    words = text.split()
    if len(words) >= 3:
        return words[len(words) // 2]
    assert len(text.strip()) >= 6, text
    middle = len(text) // 2
    return text[middle : middle + 3]


def test_stop_strings(client: openai.OpenAI, model_info: dict[str, Any]) -> None:
    full = client.chat.completions.create(model=model_info["id"], messages=_messages(), temperature=0, max_tokens=40)
    stop = _pick_stop(full.choices[0].message.content)
    r = client.chat.completions.create(model=model_info["id"], messages=_messages(), temperature=0, max_tokens=40, stop=[stop])
    assert stop not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=model_info["id"], messages=_messages(), temperature=0, max_tokens=40, stop=stop, stream=True
    )
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert stop not in text and chunks[-1].choices[0].finish_reason == "stop"


def test_32_parallel_streams(base_url: str, model_info: dict[str, Any]) -> None:
    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await aclient.chat.completions.create(
            model=model_info["id"], messages=_messages(f"Count from {i} to {i + 5}."), max_tokens=16, stream=True
        )
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", timeout=300, max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32 and all(finish in ("stop", "length") for _, finish in results)
    assert sum(bool(text) for text, _ in results) >= 30  # a reply may legitimately be just EOS
    _wait_idle(base_url)


# -- bad input: raw HTTP, status and OpenAI error body ----------------------------------------
def _bad_inputs(model: str, ctx: int) -> list[tuple[str, Any, int, str | None]]:
    chat = {"model": model, "messages": _messages("hi"), "max_tokens": 4}
    too_long = "hello " * (ctx + 16)
    return [
        ("/v1/chat/completions", b'{"messages": [', 400, None),
        ("/v1/chat/completions", {**chat, "max_tokens": "four"}, 400, "max_tokens"),
        ("/v1/chat/completions", {**chat, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user"}]}, 400, "messages[0].content"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
        ("/v1/chat/completions", {**chat, "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/chat/completions", {**chat, "max_tokens": ctx + 1}, 400, "max_tokens"),
        ("/v1/chat/completions", {**chat, "messages": _messages(too_long)}, 400, "messages"),
        ("/v1/chat/completions", {**chat, "n": 17}, 400, "n"),
        ("/v1/chat/completions", {**chat, "n": 0}, 400, "n"),
        ("/v1/chat/completions", {**chat, "model": "no-such-model"}, 404, "model"),
        ("/v1/chat/completions", {**chat, "temperature": -0.5}, 400, "temperature"),
        ("/v1/chat/completions", {**chat, "top_p": 1.5}, 400, "top_p"),
        ("/v1/chat/completions", {**chat, "top_k": -2}, 400, "top_k"),
        ("/v1/chat/completions", {**chat, "min_p": 2}, 400, "min_p"),
        ("/v1/chat/completions", {**chat, "frequency_penalty": 3}, 400, "frequency_penalty"),
        ("/v1/completions", {"model": model, "prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"model": model, "prompt": [10**7]}, 400, "prompt"),
        ("/v1/completions", {"model": model, "prompt": "a", "echo": True}, 400, "echo"),
        ("/v1/completions", {"model": model, "prompt": "a", "suffix": "b"}, 400, "suffix"),
        ("/generate", {"input_ids": [10**7], "sampling_params": {"max_new_tokens": 1}}, 400, "input_ids"),
        ("/no/such/route", {}, 404, None),
    ]


def test_bad_inputs(base_url: str, model_info: dict[str, Any]) -> None:
    for path, body, status, param in _bad_inputs(model_info["id"], model_info["max_model_len"]):
        if isinstance(body, bytes):
            r = httpx.post(base_url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
        else:
            r = httpx.post(base_url + path, json=body, timeout=60)
        assert r.status_code == status, (path, body if len(str(body)) < 200 else "...", r.text)
        err = r.json()["error"]
        assert err["code"] == status and err["message"] and err["param"] == param, (path, err)
        if status == 400:
            assert err["type"] == "invalid_request_error"
    r = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": _messages("hi"), "max_tokens": 1000000}, timeout=60)
    assert "maximum context length" in r.json()["error"]["message"]
    _wait_idle(base_url, 5)  # nothing was submitted, so nothing runs


def test_disconnect_mid_stream_aborts(base_url: str, model_info: dict[str, Any]) -> None:
    body = {"messages": _messages("Write a very long story."), "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 2:
                assert _running(base_url) >= 1  # still streaming
                break  # httpx closes the connection here: the client is gone
    _wait_idle(base_url, 5)  # the request must have been aborted, not run to 2000 tokens
    assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200
    r = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": _messages("hi"), "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


# -- native API -------------------------------------------------------------------------------
def test_generate_input_ids(base_url: str) -> None:
    body = {"input_ids": [1, 504, 3458, 314], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(f"{base_url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out["text"], str) and len(out["output_ids"]) == 6
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 6
    assert meta["finish_reason"]["type"] == "length" and "cached_tokens" in meta and meta["id"]


def test_generate_stream(base_url: str) -> None:
    body = {"text": "The capital of France is", "stream": True, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    with httpx.stream("POST", f"{base_url}/generate", json=body, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 2


def test_flush_cache(base_url: str) -> None:
    _wait_idle(base_url)
    r = httpx.post(f"{base_url}/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
