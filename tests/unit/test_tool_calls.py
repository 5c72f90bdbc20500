"""Tool calling: the output formats (whole and streamed), the grammar that forces a call,
the request checks, and the chat route end to end against a scripted fake engine.

The parsers and the route need no model; grammars are compiled and checked against each
format's text with the real SmolLM2 tokenizer, and one test decodes through the shared
offline Engine under a grammar.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance
import pytest
from fastapi.testclient import TestClient

from specserve import preflight
from specserve.args import ConfigError, parse_config
from specserve.core.config import Config, ModelConfig, ServerConfig
from specserve.core.messages import GenerateReq
from specserve.core.sampling_params import Constraint
from specserve.engine.protocol import ModelInfo
from specserve.grammar.compiler import GrammarCompiler
from specserve.server.http import build_app
from specserve.server.tool_calls import tool_grammar
from specserve.server.tool_parsers import FORMATS, ToolCall, ToolStream, split
from specserve.tokenizer.tokenizer import load_tokenizer, read_chat_template
from tests.unit.test_http import FakeEngineClient, FakeTokenizer

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "qwen25_tools.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
                   "required": ["city"], "$defs": {"Unit": {"enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]

HERMES_TWO = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
# (format, output, expected content, expected [(name, arguments)])
CASES = [
    ("qwen25", HERMES_TWO, "Let me look.\n\n",
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}', None, [("f", {})]),  # cut before </tool_call>
    ("qwen25", "a < b and <tool_call>{not json}</tool_call> c <tool", "a < b and <tool_call>{not json}</tool_call> c <tool",
     []),
    ("qwen25", "plain text", "plain text", []),
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', None,
     [("f", {"x": 1}), ("g", {})]),
    ("llama3", ' {"name": "f", "parameters": {"x": [1, 2]}}', None, [("f", {"x": [1, 2]})]),
    ("llama3", 'Use {"name": "f", "parameters": {}}', 'Use {"name": "f", "parameters": {}}', []),
    ("llama3", '{"name": "f", "parameters": {}} trailing', '{"name": "f", "parameters": {}} trailing', []),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"a": "b"}}, {"name": "g", "arguments": {}}]', "Sure. ",
     [("f", {"a": "b"}), ("g", {})]),
    ("mistral", "[TOOL_CALLS] [{\"name\": 3}]", "[TOOL_CALLS] [{\"name\": 3}]", []),
]


def _calls(calls: list[ToolCall]) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_split(parser: str, text: str, content: str | None, calls: list) -> None:
    got_content, got_calls = split(FORMATS[parser], text)
    assert (got_content, _calls(got_calls)) == (content, calls)
    assert all(c.id.startswith("call_") for c in got_calls) and len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("parser,text,content,calls", CASES)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streaming_agrees_with_split(parser: str, text: str, content: str | None, calls: list, step: int) -> None:
    """Fed in pieces of any size, the splitter emits the same text and calls as `split`."""
    stream, pieces = ToolStream(FORMATS[parser]), []
    for i in range(0, len(text), step):
        pieces += stream.feed(text[i:i + step])
    pieces += stream.finish()
    text_out = "".join(p for p in pieces if isinstance(p, str))
    assert text_out.strip() == (content or "").strip()
    assert _calls([p for p in pieces if isinstance(p, ToolCall)]) == calls


def test_content_before_a_call_streams_before_the_call_is_complete() -> None:
    stream = ToolStream(FORMATS["qwen25"])
    assert stream.feed("Hello <") == ["Hello "]  # "<" may open <tool_call>: held
    assert stream.feed("b>") == ["<b>"]
    assert stream.feed('<tool_call>\n{"name": "f", "arguments": {}}') == []
    assert _calls(stream.feed("\n</tool_call>")) == [("f", {})]


# -- grammar -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_tokenizer(smollm2_dir: Path) -> Any:
    """One real tokenizer for the tests that compile a grammar (the front end keeps one
    compiler per tokenizer, so the route tests build it once)."""
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def compiler(real_tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(real_tokenizer.to_json(), real_tokenizer.vocab_size, sorted(real_tokenizer.eos_token_ids))


# One call's text in each format, from (name, arguments JSON) pairs.
LAYOUT = {
    "qwen25": lambda calls: "\n".join(f'<tool_call>\n{{"name":"{n}","arguments":{a}}}\n</tool_call>' for n, a in calls),
    "llama3": lambda calls: "; ".join(f'{{"name":"{n}","parameters":{a}}}' for n, a in calls),
    "mistral": lambda calls: "[TOOL_CALLS] [" + ", ".join(f'{{"name":"{n}","arguments":{a}}}' for n, a in calls) + "]",
}
TZ, PARIS = ("get_time", '{"tz":"CET"}'), ("get_weather", '{"city":"Paris","unit":"C"}')


@pytest.mark.parametrize("parser", list(LAYOUT))
def test_the_grammar_admits_what_the_parser_reads(compiler: GrammarCompiler, real_tokenizer: Any, parser: str) -> None:
    """Each format's grammar accepts its calls of the offered tools and nothing else, and
    everything it accepts parses back into those calls."""
    fmt, layout = FORMATS[parser], LAYOUT[parser]
    tok = real_tokenizer

    def accepts(constraint: Constraint, calls: list[tuple[str, str]]) -> bool:
        ll = llguidance.LLMatcher(compiler.tokenizer, compiler.grammar(constraint), log_level=0)
        ids = tok.encode(layout(calls), add_special_tokens=False)
        return ll.validate_tokens(ids) == len(ids) and ll.consume_tokens(ids) and ll.is_accepting()

    many, one = (tool_grammar(fmt, TOOLS, "required", parallel) for parallel in (True, False))
    named = tool_grammar(fmt, TOOLS, {"type": "function", "function": {"name": "get_time"}}, True)
    assert accepts(many, [TZ, PARIS]) and accepts(one, [PARIS]) and accepts(named, [TZ])
    assert _calls(split(fmt, layout([TZ, PARIS]))[1]) == [("get_time", {"tz": "CET"}),
                                                          ("get_weather", {"city": "Paris", "unit": "C"})]
    assert not accepts(one, [TZ, PARIS]) and not accepts(named, [PARIS])
    assert not accepts(many, [("get_tim", '{"tz":"CET"}')])  # not an offered tool
    assert not accepts(many, [("get_time", '{"tz":"CET","x":1}')])  # a property it does not declare
    assert not accepts(many, [("get_weather", '{"city":"Paris","unit":"K"}')])  # $ref into $defs holds


@pytest.mark.slow
def test_forced_call_from_the_model_parses(engine_no_leak) -> None:
    """Greedy SmolLM2 under the grammar writes one call of an offered tool that parses."""
    tok = engine_no_leak.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "What is the weather in Paris?"}])
    fmt = FORMATS["qwen25"]
    params = {"constraint": tool_grammar(fmt, TOOLS, "required", False), "temperature": 0, "max_new_tokens": 40}
    text = engine_no_leak.generate(input_ids=prompt, sampling_params=params)["text"]
    content, calls = split(fmt, text)
    assert content is None and len(calls) == 1, text
    assert calls[0].name in ("get_weather", "get_time") and isinstance(json.loads(calls[0].arguments), dict), text


# -- the route -----------------------------------------------------------------------------
class ToolTokenizer(FakeTokenizer):
    """The fake tokenizer, rendering tools and tool-call turns into the prompt."""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list | None = None) -> str:
        head = "".join(f"<tool>{t['function']['name']}\n" for t in tools or [])
        calls = lambda m: "".join(f"<call>{json.dumps(c['function'])}" for c in m.get("tool_calls", []))  # noqa: E731
        return head + "".join(f"<{m['role']}>{m['content']}{calls(m)}\n" for m in messages) + "<assistant>"

    def encode_chat(self, messages: list[dict], tools: list | None = None) -> list[int]:
        return self.encode(self.apply_chat_template(messages, tools=tools), add_special_tokens=False)


class ScriptedEngine(FakeEngineClient):
    """Answers every request with `script`, one character per delta."""

    def __init__(self, parser: str | None = "qwen25", script: str = HERMES_TWO):
        super().__init__()
        self.config = Config(model=ModelConfig(model_path="org/fake-model"), server=ServerConfig(tool_call_parser=parser))
        self.info = ModelInfo("fake-model", 2048, 512, max_running_requests=8, max_total_tokens=4096)
        self.tokenizer = ToolTokenizer()
        self.script = script

    def letters(self, req: GenerateReq) -> str:  # type: ignore[override]
        return self.script[: req.params.max_new_tokens]


def _chat(**kw: Any) -> dict:
    return {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 400, "tools": TOOLS, **kw}


def _post(fake: FakeEngineClient, body: dict) -> Any:
    with TestClient(build_app(fake)) as http:
        return http.post("/v1/chat/completions", json=body)


def _events(fake: FakeEngineClient, body: dict) -> list[dict]:
    with TestClient(build_app(fake)) as http:
        text = http.post("/v1/chat/completions", json={**body, "stream": True}).text
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_auto_answers_with_parsed_calls() -> None:
    fake = ScriptedEngine()
    choice = _post(fake, _chat()).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "Let me look.\n\n"
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {"tz": "CET"})]
    assert fake.submitted[0].params.constraint is None  # auto: free sampling
    assert "<tool>get_weather" in fake.tokenizer.decode(fake.submitted[0].input_ids)


def test_streamed_calls_come_as_openai_deltas() -> None:
    events = _events(ScriptedEngine(), _chat())
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Let me look.\n\n"
    pieces = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [set(p) for p in pieces] == [{"index", "id", "type", "function"}, {"index", "function"}] * 2
    assert [p["index"] for p in pieces] == [0, 0, 1, 1]
    assert pieces[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert json.loads(pieces[1]["function"]["arguments"]) == {"city": "Paris"}
    assert pieces[2]["id"].startswith("call_") and pieces[2]["function"]["name"] == "get_time"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)


def test_none_renders_tools_and_answers_text() -> None:
    fake = ScriptedEngine(parser=None)
    choice = _post(fake, _chat(tool_choice="none")).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": HERMES_TWO}
    assert choice["finish_reason"] != "tool_calls"
    assert "<tool>get_time" in fake.tokenizer.decode(fake.submitted[0].input_ids)


def _real(tokenizer: Any, parser: str = "qwen25") -> ScriptedEngine:
    fake = ScriptedEngine(parser)
    fake.tokenizer = tokenizer
    fake.info = ModelInfo("fake-model", 2048, tokenizer.vocab_size, 8, 4096)
    return fake


@pytest.mark.parametrize("parser", ["qwen25", "mistral"])
def test_forced_choices_carry_the_grammar(real_tokenizer: Any, parser: str) -> None:
    fake = _real(real_tokenizer, parser)
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in ("required", named):
        assert _post(fake, _chat(tool_choice=choice)).status_code == 200
    required, named_req = (r.params for r in fake.submitted)
    assert required.constraint == tool_grammar(FORMATS[parser], TOOLS, "required", True)
    assert named_req.constraint == tool_grammar(FORMATS[parser], TOOLS, named, True)
    assert required.skip_special_tokens is (parser != "mistral")  # [TOOL_CALLS] is a special token


def test_a_tool_call_conversation_renders() -> None:
    fake = ScriptedEngine(script="It is sunny.")
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = _post(fake, _chat(messages=messages))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    prompt = fake.tokenizer.decode(fake.submitted[0].input_ids)
    assert '<assistant><call>{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt  # arguments as an object
    assert "<tool>sunny" in prompt


NAMED_MISSING = {"type": "function", "function": {"name": "nope"}}
BAD = [
    (_chat(tools=[{"type": "function", "function": {"description": "x"}}]), "tools", "needs a 'name'"),
    (_chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools", "type must be 'function'"),
    (_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]), "tools", "JSON schema object"),
    (_chat(tool_choice=NAMED_MISSING), None, "'nope', which is not among `tools`"),
    (_chat(tool_choice="always"), "tool_choice", 'must be "none", "auto", "required"'),
    (_chat(tools=None, tool_choice="required"), None, "tool_choice required needs `tools`"),
    (_chat(tool_choice="required", response_format={"type": "json_object"}), None, "cannot be combined"),
    (_chat(messages=[{"role": "assistant"}]), "messages[0].content", "except an assistant message with tool_calls"),
    (_chat(messages=[{"role": "user", "content": "x", "tool_calls": []}]), "messages[0].tool_calls",
     "only assistant messages"),
    (_chat(messages=[{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]),
     "messages[0].tool_calls", "tool_calls[0] must be"),
]


@pytest.mark.parametrize("body,param,needle", BAD)
def test_bad_tool_input_is_a_400(body: dict, param: str | None, needle: str) -> None:
    fake = ScriptedEngine()
    r = _post(fake, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == param, err
    assert not fake.submitted


def test_tools_without_a_parser_are_refused() -> None:
    r = _post(ScriptedEngine(parser=None), _chat())
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]


def test_a_schema_that_does_not_compile_is_a_400(real_tokenizer: Any) -> None:
    fake = _real(real_tokenizer)
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "strnig"}}}}}
    r = _post(fake, _chat(tools=[bad], tool_choice="required"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "strnig" in r.json()["error"]["message"]
    assert _post(fake, _chat(tools=[bad])).status_code == 200  # auto: the schema is only rendered
    assert not fake.submitted[0].params.constraint


# -- start-up ------------------------------------------------------------------------------
def test_an_unknown_parser_fails_at_start_up() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(["--tool-call-parser", "qwen3"], device_has_cuda=False)
    assert str(info.value) == "--tool-call-parser qwen3: expected one of qwen25, hermes, llama3, mistral"
    assert parse_config(["--tool-call-parser", "hermes"], device_has_cuda=False).server.tool_call_parser == "hermes"


def test_a_bad_chat_template_fails_before_the_model_is_looked_at(monkeypatch, tmp_path: Path) -> None:
    def no_target(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the target was resolved before the chat template was checked")

    monkeypatch.setattr(preflight, "resolve_model_dir", no_target)
    with pytest.raises(ValueError, match="chat template /nonexistent.jinja does not exist"):
        preflight.resolve_sources(parse_config(["--chat-template", "/nonexistent.jinja"], device_has_cuda=False))
    broken = tmp_path / "t.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="is not valid jinja"):
        preflight.resolve_sources(parse_config(["--chat-template", str(broken)], device_has_cuda=False))
    assert "<tools>" in read_chat_template(TEMPLATE)
