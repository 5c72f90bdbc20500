"""HTTP layer tests against a fake engine: routes, SSE shapes, n>1, logprobs, bad input,
auth (disconnects: test_http_disconnect.py). No model, no engine process; each test runs in milliseconds.

`FakeEngineClient` implements `specserve.engine.protocol.EngineClient`: it "generates"
consecutive letters from a start derived from the prompt and seed, applies stop strings with
hold-back like the real detokenizer, and records every submitted request and every abort.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from specserve.core.config import Config, ModelConfig, ServerConfig
from specserve.core.messages import GenerateReq, TokenLogprob, TokenOut
from specserve.engine.protocol import ModelInfo
from specserve.server.http import build_app

VOCAB = 512
CTX = 64


class FakeTokenizer:
    """One token per character (code point < VOCAB); 1 is BOS, 2 is EOS."""

    vocab_size = VOCAB
    eos_token_ids = [2]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) if ord(c) < VOCAB else 3 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i >= 32 or not skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if all(m["role"] == "system" for m in messages):
            raise ValueError("the conversation has no user message")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.apply_chat_template(messages))

    def token_str(self, token_id: int) -> str:
        return chr(token_id) if token_id >= 32 else f"<{token_id}>"


class FakeEngineClient:
    def __init__(self, api_key: str | None = None, delay: float = 0.0, enable_metrics: bool = True):
        self.config = Config(model=ModelConfig(model_path="org/fake-model"),
                             server=ServerConfig(api_key=api_key, enable_metrics=enable_metrics))
        self.info = ModelInfo("fake-model", CTX, VOCAB, max_running_requests=8, max_total_tokens=4096)
        self.tokenizer = FakeTokenizer()
        self.delay = delay
        self.submitted: list[GenerateReq] = []
        self.aborted: list[str] = []
        self.running = 0
        self.alive = True
        self.flush_ok = True
        self.fail_after: int | None = None  # raise RuntimeError after this many tokens
        self.engine_abort = False  # finish with {"type": "abort"} instead of generating
        self.reject: str | None = None  # raise ValueError before submitting

    @staticmethod
    def letters(req: GenerateReq) -> str:
        """The text an unstopped request produces: consecutive letters from a start."""
        start = (sum(req.input_ids) + (req.params.seed or 0)) % 26
        return "".join(chr(97 + (start + k) % 26) for k in range(req.params.max_new_tokens or 0))

    async def generate(self, req: GenerateReq) -> AsyncIterator[TokenOut]:
        if self.reject:
            raise ValueError(self.reject)
        self.submitted.append(req)
        self.running += 1
        done = False
        try:
            async for out in self._run(req):
                done = done or out.finished
                yield out
        finally:
            self.running -= 1
            if not done:
                self.aborted.append(req.rid)

    async def _run(self, req: GenerateReq) -> AsyncIterator[TokenOut]:
        base = dict(rid=req.rid, prompt_tokens=len(req.input_ids), cached_tokens=1)
        if self.engine_abort:
            yield TokenOut(token_ids=[], text="", finished=True, finish_reason={"type": "abort", "message": "engine says no"}, **base)
            return
        pending, stops, text = "", req.params.stop, self.letters(req)
        for k, ch in enumerate(text):
            await asyncio.sleep(self.delay)
            if self.fail_after is not None and k >= self.fail_after:
                raise RuntimeError("boom")
            pending += ch
            hit = min((pending.index(s) for s in stops if s in pending), default=None)
            last = hit is not None or k == len(text) - 1
            if hit is not None:
                release, reason = pending[:hit], {"type": "stop", "matched": next(s for s in stops if s in pending)}
            else:
                hold = max((i for s in stops for i in range(1, len(s)) if pending.endswith(s[:i])), default=0)
                release, pending = pending[: len(pending) - hold], pending[len(pending) - hold :]
                reason = {"type": "length"} if last else None
            lps = [TokenLogprob(ord(ch), -0.25, [(ord(ch), -0.25), (ord(ch) + 1, -2.0), (ord(ch) + 2, float("-inf"))][: req.params.top_logprobs])] if req.params.logprobs else []
            meta = {"spec_verify_ct": k + 1, "spec_accept_length": 1.5} if last else {}
            yield TokenOut(token_ids=[ord(ch)], text=release, finished=last, finish_reason=reason, completion_tokens=k + 1, logprobs=lps, meta=meta, **base)
            if last:
                return
        yield TokenOut(token_ids=[], text="", finished=True, finish_reason={"type": "length"}, completion_tokens=0, **base)

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    async def control(self, op: str) -> Any:
        if op == "server_info":
            return {"model_path": "org/fake-model", "internal_states": [{"avg_spec_accept_length": 1.5}]}
        if op == "metrics":
            return {"num_running_reqs": self.running, "spec_accept_length": 1.5, "spec_accept_rate": 0.5, "prompt_tokens_total": 7}
        if op == "flush_cache":
            return self.flush_ok
        raise ValueError(op)

    def is_alive(self) -> bool:
        return self.alive


@pytest.fixture
def fake() -> FakeEngineClient:
    return FakeEngineClient()


@pytest.fixture
def http(fake: FakeEngineClient) -> TestClient:
    return TestClient(build_app(fake))


def chat(**kw: Any) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **kw}


def sse_events(text: str) -> list[Any]:
    """Parse an SSE body: every event must be a `data:` line followed by a blank line."""
    assert text.endswith("data: [DONE]\n\n")
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [json.loads(e[6:]) for e in events[:-1]]


# -- happy paths ------------------------------------------------------------------------------
def test_chat_non_streaming(http: TestClient, fake: FakeEngineClient) -> None:
    r = http.post("/v1/chat/completions", json=chat(temperature=0))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "fake-model"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": FakeEngineClient.letters(fake.submitted[0])}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    prompt_len = len(fake.submitted[0].input_ids)
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 5, "total_tokens": prompt_len + 5, "prompt_tokens_details": {"cached_tokens": 1}}
    req = fake.submitted[0]
    assert req.rid == body["id"] and req.params.temperature == 0.0 and req.params.max_new_tokens == 5
    assert req.input_ids == fake.tokenizer.encode_chat([{"role": "user", "content": "hi"}])


def test_chat_streaming_shapes(http: TestClient, fake: FakeEngineClient) -> None:
    r = http.post("/v1/chat/completions", json=chat(stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1])
    assert content == FakeEngineClient.letters(fake.submitted[0])
    assert [e["choices"][0]["finish_reason"] for e in events[1:-1]] == [None] * 4 + ["length"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


def test_stop_string_is_trimmed(http: TestClient, fake: FakeEngineClient) -> None:
    full = http.post("/v1/chat/completions", json=chat(max_tokens=8)).json()["choices"][0]["message"]["content"]
    for stream in (False, True):
        r = http.post("/v1/chat/completions", json=chat(max_tokens=8, stop=full[3:5], stream=stream))
        if stream:
            events = sse_events(r.text)
            text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
            reason = events[-1]["choices"][0]["finish_reason"]
        else:
            text, reason = r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["finish_reason"]
        assert (text, reason) == (full[:3], "stop")
    assert fake.submitted[-1].params.stop == [full[3:5]]


def test_n_choices_and_seeds(http: TestClient, fake: FakeEngineClient) -> None:
    body = http.post("/v1/chat/completions", json=chat(n=3, seed=7)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [r.rid for r in fake.submitted] == [f"{body['id']}-{i}" for i in range(3)]
    assert [r.params.seed for r in fake.submitted] == [7, 8, 9]
    assert len({c["message"]["content"] for c in body["choices"]}) == 3
    assert body["usage"]["completion_tokens"] == 15 and body["usage"]["prompt_tokens"] == len(fake.submitted[0].input_ids)
    events = sse_events(http.post("/v1/chat/completions", json=chat(n=2, stream=True)).text)
    assert sorted(e["choices"][0]["index"] for e in events if e["choices"][0]["delta"].get("role")) == [0, 1]
    finals = [e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"]]
    assert sorted(finals) == [0, 1]


def test_chat_logprobs(http: TestClient) -> None:
    body = http.post("/v1/chat/completions", json=chat(logprobs=True, top_logprobs=3, max_tokens=2)).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 2
    first = content[0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert first["logprob"] == -0.25 and first["bytes"] == list(first["token"].encode())
    assert [t["logprob"] for t in first["top_logprobs"]] == [-0.25, -2.0, -9999.0]  # -inf clamped
    events = sse_events(http.post("/v1/chat/completions", json=chat(logprobs=True, stream=True, max_tokens=2)).text)
    assert all(len(e["choices"][0]["logprobs"]["content"]) == 1 for e in events[1:])


def test_completions(http: TestClient, fake: FakeEngineClient) -> None:
    body = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "logprobs": 1}).json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == FakeEngineClient.letters(fake.submitted[0]) and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == list(choice["text"]) and lp["text_offset"] == [0, 1, 2]
    assert lp["token_logprobs"] == [-0.25] * 3 and all(len(t) == 1 for t in lp["top_logprobs"])
    assert fake.submitted[0].input_ids == [1, 97, 98, 99]


def test_completions_batch_and_stream(http: TestClient, fake: FakeEngineClient) -> None:
    body = http.post("/v1/completions", json={"prompt": [[5, 6], [7]], "n": 2, "max_tokens": 2}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [r.input_ids for r in fake.submitted] == [[5, 6], [5, 6], [7], [7]]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 8
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == FakeEngineClient.letters(fake.submitted[-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1]["usage"]["total_tokens"] == 5


def test_max_tokens_defaults_to_rest_of_context(http: TestClient, fake: FakeEngineClient) -> None:
    http.post("/v1/completions", json={"prompt": [1, 2, 3, 4]})
    assert fake.submitted[0].params.max_new_tokens == CTX - 4


def test_generate_native(http: TestClient, fake: FakeEngineClient) -> None:
    body = http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).json()
    assert body["text"] == FakeEngineClient.letters(fake.submitted[0]) and len(body["output_ids"]) == 3
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 3 and meta["cached_tokens"] == 1
    assert meta["finish_reason"] == {"type": "length"} and meta["spec_verify_ct"] == 3 and meta["spec_accept_length"] == 1.5
    assert meta["id"] == fake.submitted[0].rid
    body = http.post("/generate", json={"text": ["a", "b"], "rid": ["r1", "r2"], "return_logprob": True, "top_logprobs_num": 2}).json()
    assert [o["meta_info"]["id"] for o in body] == ["r1", "r2"]
    assert fake.submitted[-1].params.max_new_tokens == CTX - 2  # min(128 SGLang default, room left)
    assert len(body[0]["meta_info"]["output_top_logprobs"][0]) == 2


def test_generate_streaming_is_cumulative(http: TestClient, fake: FakeEngineClient) -> None:
    events = sse_events(http.post("/generate", json={"text": "q", "stream": True, "sampling_params": {"max_new_tokens": 3}}).text)
    full = FakeEngineClient.letters(fake.submitted[0])
    assert [e["text"] for e in events] == [full[:1], full[:2], full]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length"} and events[0]["meta_info"]["finish_reason"] is None


def test_simple_routes(http: TestClient, fake: FakeEngineClient) -> None:
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["fake-model"]
    assert http.get("/v1/models/fake-model").status_code == 200 and http.get("/v1/models/nope").status_code == 404
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200 and fake.submitted[-1].params.max_new_tokens == 1
    for path in ("/get_server_info", "/server_info"):
        assert http.get(path).json()["internal_states"][0]["avg_spec_accept_length"] == 1.5
    metrics = http.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    for line in ("specserve:num_running_reqs 0.0", "sglang:spec_accept_length 1.5", "sglang:spec_accept_rate 0.5", "specserve:prompt_tokens_total 7.0"):
        assert line in metrics.text.splitlines()
    assert http.post("/flush_cache").json()["success"] is True
    fake.flush_ok, fake.alive = False, False
    assert http.post("/flush_cache").status_code == 400
    assert http.get("/health").status_code == 503


def test_metrics_are_served_only_with_enable_metrics() -> None:
    """--enable-metrics off (the default, as in SGLang): no /metrics route at all."""
    without = TestClient(build_app(FakeEngineClient(enable_metrics=False)))
    assert without.get("/metrics").status_code == 404
    assert without.get("/health").status_code == 200


# -- bad input: a 4xx with an OpenAI error body, and nothing reaches the engine ----------------
LONG = "x" * (CTX + 5)
BAD_INPUTS = [
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, None, "`tools` is not supported"),
    ("/v1/chat/completions", chat(logit_bias={"5": 101}), 400, "logit_bias", "must be in [-100, 100]"),
    ("/v1/chat/completions", chat(logit_bias={str(VOCAB): 1}), 400, "logit_bias", "out of range"),
    ("/v1/chat/completions", chat(logit_bias={"five": 1}), 400, None, "keys must be token ids"),
    ("/v1/chat/completions", chat(response_format={"type": "xml"}), 400, None, "response_format type must be"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema"}), 400, None, "needs a `json_schema` object"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}, "guided_regex": "a+"}, 400, None,
     "at most one of"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty", "repetition_penalty"),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}, 400, "sampling_params", "at most one of"),
    ("/v1/chat/completions", '{"messages": [', 400, None, "Malformed JSON"),
    ("/v1/chat/completions", chat(max_tokens="ten"), 400, "max_tokens", "max_tokens"),
    ("/v1/chat/completions", chat(temperature="hot"), 400, "temperature", "temperature"),
    ("/v1/chat/completions", chat(stream="yes"), 400, "stream", "stream"),
    ("/v1/chat/completions", chat(messages="hi"), 400, "messages", "messages"),
    ("/v1/chat/completions", chat(messages=[]), 400, "messages", "at least one message"),
    ("/v1/chat/completions", {"max_tokens": 3}, 400, "messages", "Missing required parameter"),
    ("/v1/chat/completions", chat(messages=[{"role": "user"}]), 400, "messages[0].content", "content"),
    ("/v1/chat/completions", chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role", "robot"),
    ("/v1/chat/completions", chat(messages=[{"role": "system", "content": "x"}]), 400, "messages", "no user message"),
    ("/v1/chat/completions", chat(max_tokens=-1), 400, "max_tokens", "greater than or equal to 0"),
    ("/v1/chat/completions", chat(max_tokens=1000), 400, "max_tokens", "maximum context length is 64 tokens. However, you requested"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": LONG}]), 400, "messages", "maximum context length is 64"),
    ("/v1/chat/completions", chat(n=17), 400, "n", "less than or equal to 16"),
    ("/v1/chat/completions", chat(n=0), 400, "n", "greater than or equal to 1"),
    ("/v1/chat/completions", chat(model="gpt-9"), 404, "model", "The model `gpt-9` does not exist"),
    ("/v1/chat/completions", chat(temperature=101), 400, "temperature", "temperature"),
    ("/v1/chat/completions", chat(top_p=0), 400, "top_p", "top_p"),
    ("/v1/chat/completions", chat(top_k=VOCAB + 1), 400, "top_k", "top_k"),
    ("/v1/chat/completions", chat(min_p=2), 400, "min_p", "min_p"),
    ("/v1/chat/completions", chat(presence_penalty=3), 400, "presence_penalty", "presence_penalty"),
    ("/v1/chat/completions", chat(top_logprobs=21, logprobs=True), 400, "top_logprobs", "top_logprobs"),
    ("/v1/chat/completions", chat(top_logprobs=2), 400, None, "requires logprobs"),
    ("/v1/chat/completions", chat(stop=[1]), 400, "stop", "string"),
    ("/v1/chat/completions", chat(stop_token_ids=[VOCAB]), 400, "stop_token_ids", "stop_token_ids"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "messages[0].content", "only text content parts"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content", "string"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt", "non-empty"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt", "token ids"),
    ("/v1/completions", {"prompt": [1, VOCAB]}, 400, "prompt", "out of vocabulary"),
    ("/v1/completions", {"prompt": "a", "echo": True}, 400, "echo", "echo is not supported"),
    ("/v1/completions", {"prompt": "a", "suffix": "b"}, 400, "suffix", "suffix is not supported"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt", "maximum context length is 64"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 63}, 400, "max_tokens", "you requested 65 tokens (2 in the prompt, 63 in the completion)"),
    ("/v1/completions", {"prompt": "a", "logprobs": -1}, 400, "logprobs", "logprobs"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs", "top_logprobs must be in [0, 20]"),
    ("/generate", {"text": "a", "return_logprob": True, "top_logprobs_num": 21}, 400, "top_logprobs_num", "top_logprobs"),
    ("/generate", {"text": "a", "sampling_params": {"seed": -1}}, 400, "sampling_params.seed", "seed"),
    ("/generate", {"text": "a", "input_ids": [1]}, 400, None, "exactly one of"),
    ("/generate", {"input_ids": [-1]}, 400, "input_ids", "out of vocabulary"),
    ("/generate", {"text": "a", "sampling_params": {"temperature": -1}}, 400, "sampling_params.temperature", "temperature"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": "x"}}, 400, "sampling_params.max_new_tokens", "integer"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 100}}, 400, "sampling_params.max_new_tokens",
     "maximum context length"),
    ("/generate", {"input_ids": [5] * 70}, 400, "input_ids", "maximum context length"),
    ("/generate", {"text": "x" * 70}, 400, "text", "maximum context length"),
    ("/generate", [1, 2], 400, None, "JSON object"),
]


@pytest.mark.parametrize("path,body,status,param,needle", BAD_INPUTS)
def test_bad_input(http: TestClient, fake: FakeEngineClient, path: str, body: Any, status: int, param: str | None, needle: str) -> None:
    if isinstance(body, str):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert needle in err["message"] and err["param"] == param, err
    assert fake.submitted == []


def test_unknown_route_and_method_are_json(http: TestClient) -> None:
    r = http.get("/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_fastapi_422_becomes_400(fake: FakeEngineClient) -> None:
    app = build_app(fake)

    @app.get("/probe")
    async def probe(count: int) -> dict:  # FastAPI validates the query itself
        return {"count": count}

    r = TestClient(app).get("/probe", params={"count": "many"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "count"


def test_body_without_json_content_type_is_accepted(http: TestClient, fake: FakeEngineClient) -> None:
    r = http.post("/v1/completions", content=json.dumps({"prompt": "a", "max_tokens": 1}), headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text


def test_model_aliases(http: TestClient, fake: FakeEngineClient) -> None:
    for model in ("fake-model", "org/fake-model"):
        assert http.post("/v1/chat/completions", json=chat(model=model)).status_code == 200
    body = chat()
    del body["model"]
    assert http.post("/v1/chat/completions", json=body).json()["model"] == "fake-model"


def test_engine_refusal_is_400_even_when_streaming(http: TestClient, fake: FakeEngineClient) -> None:
    fake.reject = "prompt does not fit in the KV cache"
    for stream in (False, True):
        r = http.post("/v1/chat/completions", json=chat(stream=stream))
        assert r.status_code == 400 and "KV cache" in r.json()["error"]["message"]


def test_unexpected_errors(http: TestClient, fake: FakeEngineClient) -> None:
    fake.fail_after = 2
    r = http.post("/v1/chat/completions", json=chat())
    assert r.status_code == 500 and r.json()["error"]["code"] == 500
    events = sse_events(http.post("/v1/chat/completions", json=chat(stream=True)).text)
    assert events[-1]["error"]["code"] == 500  # the status is already sent: reported in-band
    fake.engine_abort = True
    r = http.post("/generate", json={"text": "a"})
    assert r.status_code == 500 and r.json()["error"]["message"] == "engine says no"
    fake.engine_abort, fake.alive = False, False
    assert http.post("/v1/chat/completions", json=chat()).status_code == 503  # a dead engine fails the stream
    fake.fail_after, fake.alive = None, True
    assert http.post("/v1/chat/completions", json=chat()).status_code == 200  # still serving


def test_handler_crash_is_500_json(fake: FakeEngineClient) -> None:
    async def broken(op: str) -> Any:
        raise KeyError(op)

    fake.control = broken  # type: ignore[method-assign]
    r = TestClient(build_app(fake)).get("/get_server_info")
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_server_error"


def test_api_key() -> None:
    fake = FakeEngineClient(api_key="sekret")
    http = TestClient(build_app(fake))
    assert http.get("/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        r = http.post("/v1/chat/completions", json=chat(), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert http.get("/v1/models", headers=headers).status_code == 401
    assert fake.submitted == []
    ok = {"Authorization": "Bearer sekret"}
    assert http.post("/v1/chat/completions", json=chat(), headers=ok).status_code == 200
    assert http.get("/metrics", headers=ok).status_code == 200


def test_finished_requests_are_not_aborted(http: TestClient, fake: FakeEngineClient) -> None:
    http.post("/v1/chat/completions", json=chat(n=2))
    sse_events(http.post("/v1/chat/completions", json=chat(stream=True)).text)
    assert len(fake.submitted) == 3 and fake.aborted == [] and fake.running == 0


def test_sampling_params_mapping(http: TestClient, fake: FakeEngineClient) -> None:
    http.post("/v1/chat/completions", json=chat(
        temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, frequency_penalty=0.5, presence_penalty=-0.5,
        stop="zz", stop_token_ids=[2], seed=3, ignore_eos=True, max_completion_tokens=4, user="u", unknown_extra={"a": 1},
    ))
    p = fake.submitted[0].params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.frequency_penalty, p.presence_penalty) == (0.5, 0.9, 5, 0.1, 0.5, -0.5)
    assert (p.stop, p.stop_token_ids, p.seed, p.ignore_eos, p.max_new_tokens) == (["zz"], [2], 3, True, 4)
    http.post("/generate", json={"text": "a", "sampling_params": {"sampling_seed": 9, "stop": ["q"], "top_k": 3}})
    p = fake.submitted[1].params
    assert (p.seed, p.stop, p.top_k) == (9, ["q"], 3) and replace(p, seed=None).seed is None
