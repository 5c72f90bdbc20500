"""Tool-call formats: model output -> content and tool calls (whole or streamed), and the
Lark rules that force a call in each format.

Owns the formats `--tool-call-parser` names (SGLang's names): `qwen25` (alias `hermes`):
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number, text around
them; `llama3`: `{"name": ..., "parameters": {...}}` objects separated by `;`, optionally
after `<|python_tag|>`, and only as the whole output; `mistral`: `[TOOL_CALLS] [{"name": ...,
"arguments": {...}}, ...]` to the end of the output. A format is a start marker, an optional
end marker and a function that reads one call region; `ToolStream` splits any of them.
It knows nothing about HTTP, requests or the tools a request offered.

Invariants:
- `split` is `ToolStream` fed the whole text: streamed and final answers always agree.
- No text is lost: a region that does not parse comes back as content, verbatim.
- Content is held back only while it could still be the start of a call marker, and a call
  is emitted whole, once its region is complete.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

TOOL_CALL_PARSERS = ("qwen25", "hermes", "llama3", "mistral")  # hermes: vLLM's name for qwen25's format


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)


Piece = str | ToolCall  # what a splitter emits: content text or a whole call


@dataclass(frozen=True)
class ToolFormat:
    """One output format. `grammar(many)` is the Lark `start` rule of forced calls, written
    over a rule `tool_body` (one call's JSON object, built by server/tool_calls.py)."""

    name: str
    starts: tuple[str, ...]  # markers that open a call region
    end: str | None  # closes a region; None: the region runs to the end of the output
    read: Callable[[str], list[ToolCall] | None]  # a whole region -> its calls (None: not calls)
    args_key: str  # the key of the arguments object in a call
    grammar: Callable[[bool], str]
    at_start_only: bool = False  # a region opens only at the start of the output (llama3)
    keep_special_tokens: bool = False  # the start marker is a special token (mistral's [TOOL_CALLS])


def _call(obj: object, args_key: str) -> ToolCall | None:
    """{"name": str, args_key: object (or its JSON text)} -> a ToolCall; None otherwise."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str, sep: str | None) -> list[object] | None:
    """The JSON values of `text`, separated by `sep` (None: exactly one value), whitespace
    around them allowed; None when `text` is anything else."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        values.append(value)
        rest = text[pos:].lstrip()
        if not rest:
            return values
        if sep is None or not rest.startswith(sep):
            return None
        pos = len(text) - len(rest) + len(sep)


def _strip(region: str, start: str, end: str | None) -> str:
    region = region.strip()
    region = region[len(start):] if region.startswith(start) else region
    return region[: -len(end)] if end and region.endswith(end) else region


def _calls(values: list[object] | None, args_key: str) -> list[ToolCall] | None:
    """Every value as a call, or None if any is not one."""
    calls = [_call(v, args_key) for v in values or []]
    return [c for c in calls if c is not None] if calls and None not in calls else None


def _read_hermes(region: str) -> list[ToolCall] | None:
    return _calls(_json_values(_strip(region, "<tool_call>", "</tool_call>"), None), "arguments")


def _read_llama3(region: str) -> list[ToolCall] | None:
    return _calls(_json_values(_strip(region, "<|python_tag|>", None), ";"), "parameters")


def _read_mistral(region: str) -> list[ToolCall] | None:
    values = _json_values(_strip(region, "[TOOL_CALLS]", None), None)
    if values is not None and isinstance(values[0], list):
        values = values[0]
    return _calls(values, "arguments")


def _repeat(call: str, sep: str, many: bool) -> str:
    return f"{call} ({sep} {call})*" if many else call


_HERMES = ToolFormat(
    "qwen25", ("<tool_call>",), "</tool_call>", _read_hermes, "arguments",
    lambda many: f"start: {_repeat('call', json.dumps(chr(10)), many)}\n"
                 'call: "<tool_call>\\n" tool_body "\\n</tool_call>"')
FORMATS: dict[str, ToolFormat] = {
    "qwen25": _HERMES,
    "hermes": _HERMES,
    "llama3": ToolFormat("llama3", ("<|python_tag|>", "{"), None, _read_llama3, "parameters",
                         lambda many: f"start: {_repeat('tool_body', json.dumps('; '), many)}", at_start_only=True),
    "mistral": ToolFormat("mistral", ("[TOOL_CALLS]",), None, _read_mistral, "arguments",
                          lambda many: f'start: "[TOOL_CALLS] [" {_repeat("tool_body", json.dumps(", "), many)} "]"',
                          keep_special_tokens=True),
}
assert set(FORMATS) == set(TOOL_CALL_PARSERS)


class ToolStream:
    """Splits one choice's streamed output into content text and whole tool calls."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self._buf = ""  # text not yet emitted
        self._in_call = False  # _buf starts with a start marker
        self._plain = False  # at_start_only formats: the output began with text, so it is all text
        self.calls = 0  # calls emitted so far

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Piece]:
        """Whatever is left at the end of the output: an open region is read as it stands."""
        out = self.feed("")
        if self._buf:
            out += self._region(self._buf) if self._in_call else [self._buf]
        self._buf, self._in_call = "", False
        return out

    def _step(self, out: list[Piece]) -> bool:
        """Emit what can be emitted; True when a region opened or closed (look again)."""
        if self._in_call:
            end = self.fmt.end
            j = -1 if end is None else self._buf.find(end)
            if end is None or j < 0:
                return False
            out += self._region(self._buf[: j + len(end)])
            self._buf, self._in_call = self._buf[j + len(end):], False
            return True
        at, held = self._find_start()
        if at is not None:
            if at:
                out.append(self._buf[:at])
            self._buf, self._in_call = self._buf[at:], True
            return True
        if len(self._buf) > held:
            out.append(self._buf[: len(self._buf) - held])
            self._buf = self._buf[len(self._buf) - held:]
        return False

    def _find_start(self) -> tuple[int | None, int]:
        """(where a start marker begins in _buf or None, how many trailing chars to hold back)."""
        buf, starts = self._buf, self.fmt.starts
        if self.fmt.at_start_only:
            if self._plain:
                return None, 0
            body = buf.lstrip()
            if any(body.startswith(s) for s in starts):
                return len(buf) - len(body), 0
            if any(s.startswith(body) for s in starts):  # still could be (empty included)
                return None, len(buf)
            self._plain = True
            return None, 0
        found = [i for i in (buf.find(s) for s in starts) if i >= 0]
        if found:
            return min(found), 0
        held = max((k for s in starts for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        return None, held

    def _region(self, region: str) -> list[Piece]:
        calls = self.fmt.read(region)
        if not calls:
            return [region]
        self.calls += len(calls)
        return list(calls)


def split(fmt: ToolFormat, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole output -> (content, calls); content is None when calls were found and only
    whitespace surrounds them."""
    stream = ToolStream(fmt)
    pieces = stream.feed(text) + stream.finish()
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    content = "".join(p for p in pieces if isinstance(p, str))
    return (None if calls and not content.strip() else content), calls
