"""End-to-end tool calling: one real server (`--tool-call-parser qwen25`, a Qwen2.5-style
`--chat-template` that renders tools, NGRAM speculation) driven with the official `openai`
client, streaming and not: `auto` (the model calls on its own, after a few examples in the
conversation), `required` and a named function (forced by the grammar), `none` (text).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.server_utils import launched_server

pytestmark = pytest.mark.slow

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "qwen25_tools.jinja"
TOOLS: list[Any] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the current time in a time zone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
]


def _call_turn(city: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": f"call_{city.lower()}", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}


# Three examples of the call format: SmolLM2-135M then calls on its own.
FEW_SHOT: list[Any] = [m for city in ("Berlin", "Rome", "Oslo")
                       for m in ({"role": "user", "content": f"Weather in {city}?"}, _call_turn(city))]
ASK: list[Any] = FEW_SHOT + [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--tool-call-parser", "qwen25", "--chat-template", str(TEMPLATE), "--speculative-algorithm", "NGRAM"]
    with launched_server(args, log_path) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", timeout=300, max_retries=0)


def _create(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(model=client.models.list().data[0].id, tools=TOOLS, temperature=0,
                                          max_tokens=40, **kw)


def _streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, list[tuple[str, dict]], str | None]:
    """(content, [(name, arguments)], finish_reason) assembled from the chunks."""
    content, calls, finish = "", {}, None
    for chunk in _create(client, stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"name": "", "arguments": ""})
            if piece.function and piece.function.name:
                assert piece.id and piece.id.startswith("call_") and not call["name"]
                call["name"] = piece.function.name
            if piece.function and piece.function.arguments:
                call["arguments"] += piece.function.arguments
        finish = choice.finish_reason or finish
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish


def test_auto_calls_a_tool_streamed_or_not(client: openai.OpenAI) -> None:
    choice = _create(client, messages=ASK).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"})]
    assert _streamed(client, messages=ASK) == ("", calls, "tool_calls")


def test_required_and_named_calls_are_forced(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "What time is it in Tokyo?"}]
    content, calls, finish = _streamed(client, messages=ask, tool_choice="required", parallel_tool_calls=False)
    assert content == "" and finish == "tool_calls" and len(calls) == 1, calls
    assert calls[0][0] in ("get_weather", "get_time") and isinstance(calls[0][1], dict)
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = _create(client, messages=ask, tool_choice=named).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and isinstance(json.loads(call.function.arguments)["tz"], str)


def test_none_answers_in_text(client: openai.OpenAI) -> None:
    choice = _create(client, messages=ASK, tool_choice="none").choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason != "tool_calls"
    assert choice.message.content  # the call format as plain text: nothing is parsed
