"""Hostile input against the HTTP layer (issue 52's table, rows 1-5, 9 and 12), over the fake
engine of test_http.py: each is a clear 4xx naming the field, or a 500/503 that tells the
client nothing of the server's internals, and none reaches the engine.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from specserve.engine.protocol import DuplicateRequestId, ShuttingDown
from specserve.server.body_guard import MAX_JSON_DEPTH
from specserve.server.http import build_app
from tests.unit.test_http import FakeEngineClient, chat

JSON = {"content-type": "application/json"}


def _client(fake: FakeEngineClient, **server: Any) -> TestClient:
    fake.config = replace(fake.config, server=replace(fake.config.server, **server))
    return TestClient(build_app(fake), raise_server_exceptions=False)


@pytest.fixture
def fake() -> FakeEngineClient:
    return FakeEngineClient()


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    ("/v1/completions", b'{"prompt": "a\\udfffb", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "a\\ud800"], "max_tokens": 2}', "prompt[1]"),
    ("/generate", b'{"text": "a\\ud800b"}', "text"),
    ("/generate", b'{"text": "a", "sampling_params": {"stop": ["\\ud800"]}}', "sampling_params.stop[0]"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(fake, path, raw, param):
    r = _client(fake).post(path, content=raw, headers=JSON)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "surrogate" in r.json()["error"]["message"]
    assert fake.submitted == []


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 5_000, 100_000])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/generate"])
def test_deeply_nested_json_is_a_400(fake, path, depth):
    raw = b'{"text": "a", "x": ' + b"[" * depth + b"]" * depth + b"}"
    r = _client(fake).post(path, content=raw, headers=JSON)
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"], r.text


def test_nesting_within_the_limit_is_served(fake):
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(8):  # a schema a few levels deep is ordinary input
        schema = {"type": "object", "properties": {"a": schema}}
    body = {"text": "a", "x": [[[[1]]]], "schema": schema}
    assert _client(fake).post("/generate", json=body).status_code == 200


def test_a_body_over_the_limit_is_a_413_before_it_is_parsed(fake):
    http = _client(fake, max_request_mb=0.01)
    big = {"prompt": "x" * 20_000, "max_tokens": 1}
    r = http.post("/v1/completions", json=big)
    assert r.status_code == 413 and "--max-request-mb" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted while it arrives
        for _ in range(20):
            yield b" " * 1024
    r = http.post("/v1/completions", content=chunks(), headers=JSON)
    assert r.status_code == 413
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    assert fake.submitted and all(len(r.input_ids) < 10 for r in fake.submitted)


def test_prompts_times_n_is_capped(fake):
    http = _client(fake, max_choices_per_request=8)
    r = http.post("/v1/completions", json={"prompt": ["a"] * 5, "n": 2, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    r = http.post("/v1/chat/completions", json=chat(n=9))
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = http.post("/generate", json={"text": ["a"] * 9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text"
    assert fake.submitted == []
    assert http.post("/v1/completions", json={"prompt": ["a"] * 4, "n": 2, "max_tokens": 1}).status_code == 200


def test_duplicate_rids_in_one_batch_are_a_400(fake):
    r = _client(fake).post("/generate", json={"text": ["a", "b"], "rid": ["dup", "dup"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
    assert fake.submitted == []


@pytest.mark.parametrize("exc, status, type_", [
    (DuplicateRequestId("a request with rid 'x' is already in flight"), 409, "conflict_error"),
    (ShuttingDown("the server is shutting down"), 503, "service_unavailable"),
])
def test_engine_refusals_map_to_their_status(fake, monkeypatch, exc, status, type_):
    async def refuse(req):
        raise exc
        yield  # an async generator, as generate is

    monkeypatch.setattr(fake, "generate", refuse)
    for stream in (False, True):
        r = _client(fake).post("/generate", json={"text": "a", "rid": "x", "stream": stream})
        assert r.status_code == status and r.json()["error"]["type"] == type_, r.text


def test_a_500_names_an_error_id_not_the_exception(fake, monkeypatch, caplog):
    async def broken(op):
        raise RuntimeError("secret internals at /srv/keys")

    monkeypatch.setattr(fake, "control", broken)
    r = _client(fake).get("/get_server_info")
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert "secret" not in message and "RuntimeError" not in message and "error id" in message
    error_id = message.split("error id ")[1].split(")")[0]
    assert any(error_id in rec.getMessage() and rec.exc_info for rec in caplog.records)


def test_an_engine_failure_mid_stream_names_an_error_id(fake):
    fake.fail_after = 2
    r = _client(fake).post("/generate", json={"text": "a", "stream": True})
    assert "boom" not in r.text and "error id" in r.text


def test_the_api_key_is_never_echoed_and_bearer_is_case_insensitive(monkeypatch):
    fake = FakeEngineClient(api_key="sekrit-123")

    async def info(op):
        return {"server": {"api_key": "sekrit-123", "port": 1}, "spec": [{"api_key": None}]}

    monkeypatch.setattr(fake, "control", info)
    http = _client(fake)
    for scheme in ("Bearer", "bearer", "BEARER"):
        r = http.get("/get_server_info", headers={"Authorization": f"{scheme} sekrit-123"})
        assert r.status_code == 200 and "sekrit" not in r.text, r.text
        assert r.json()["server"] == {"api_key": "<redacted>", "port": 1}
    assert http.get("/v1/models", headers={"Authorization": "Basic sekrit-123"}).status_code == 401
    assert http.get("/v1/models", headers={"Authorization": "Bearer sekrit-12"}).status_code == 401
