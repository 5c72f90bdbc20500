"""OpenAI tool calling on /v1/chat/completions: what a request's `tools` and `tool_choice`
mean for rendering, sampling and reading the output.

Owns the checks of the tool fields (the request's `tools` and `tool_choice`, an assistant
message's `tool_calls`; called by server/protocol.py's validators, so a bad one is a 400
naming the field), the `ToolPlan` a chat request is served by, and the Lark grammar that
forces a call. The output formats themselves are server/tool_parsers.py's.

Invariants:
- `tool_choice` "required" or a named function always carries a grammar in the
  `--tool-call-parser` format, so the output parses as calls (unless cut by max_tokens).
- "auto" samples freely and parses; "none" renders the tools but never parses.
- A request that needs a parser the server was not started with is refused (400), never
  served as plain text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from specserve.core.sampling_params import Constraint, SamplingParams
from specserve.server.errors import bad_request
from specserve.server.tool_parsers import FORMATS, TOOL_CALL_PARSERS, ToolFormat

CHOICES = ("none", "auto", "required")
PARAM_NAMES = {"constraint": "tools"}  # a tool grammar that does not compile: a bad parameters schema


# -- request fields (server/protocol.py's validators) ------------------------------------
def check_tools(value: Any) -> list[dict] | None:
    """OpenAI's `tools`: [{"type": "function", "function": {"name", "description"?,
    "parameters"?}}]; an empty list is no tools."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError("must be a list of tools")
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise ValueError(f"tools[{i}] must be an object")
        if tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}].type must be 'function' (the only tool type supported), got {tool['type']!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] needs a 'function' object")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function needs a 'name' (a non-empty string)")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ValueError(f"tools[{i}].function.description must be a string")
    return [{**t, "type": "function"} for t in value] or None


def check_tool_choice(value: Any) -> str | dict | None:
    """"none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}."""
    if value is None or value in CHOICES:
        return value
    fn = value.get("function") if isinstance(value, dict) else None
    if isinstance(fn, dict) and value.get("type", "function") == "function" \
            and isinstance(fn.get("name"), str) and fn["name"]:
        return {"type": "function", "function": {"name": fn["name"]}}
    raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


def check_tool_choice_fits(tools: list[dict] | None, choice: str | dict | None, constrained: bool) -> None:
    """The rules between fields: a forced call needs tools, a named one a tool of that name,
    and neither goes with response_format (both would be grammars)."""
    if choice is None or choice in ("none", "auto"):
        return
    what = "required" if choice == "required" else f"naming {_named(choice)!r}"
    if not tools:
        raise ValueError(f"tool_choice {what} needs `tools`")
    if isinstance(choice, dict) and _named(choice) not in {t["function"]["name"] for t in tools}:
        raise ValueError(f"tool_choice names {_named(choice)!r}, which is not among `tools`")
    if constrained:
        raise ValueError(f"tool_choice {what} cannot be combined with response_format "
                         "(or guided_json / guided_regex): both constrain the output")


def check_message_tool_calls(value: Any, role: str | None) -> list[dict] | None:
    """An assistant message's `tool_calls`, shaped for chat templates (Hugging Face's
    convention): arguments given as JSON text become the object, as templates `tojson` them."""
    if value is None:
        return None
    if role != "assistant":
        raise ValueError("only assistant messages may carry tool_calls")
    if not isinstance(value, list):
        raise ValueError("must be a list of tool calls")
    out = []
    for i, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tool_calls[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             "\"arguments\": ...}}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass  # kept as the text it is
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        out.append({"id": call["id"], **entry} if isinstance(call.get("id"), str) else entry)
    return out


def _named(choice: str | dict) -> str | None:
    """The function a tool_choice names (None for "none", "auto", "required")."""
    return choice["function"]["name"] if isinstance(choice, dict) else None


# -- the grammar of forced calls ----------------------------------------------------------
def call_schema(tool: dict, args_key: str) -> dict:
    """The JSON schema of one call of `tool`: {"name": its name, args_key: its parameters}.
    The parameters' $defs move to the root, where their "#/$defs/..." references point.
    Parameters that list their properties admit no others unless they say so (as OpenAI's
    strict mode): a function takes the arguments it declares, and a small model otherwise
    invents more until max_tokens."""
    params = dict(tool["function"].get("parameters") or {})
    defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
    params.setdefault("type", "object")  # arguments are an object whatever else the schema says
    if "properties" in params:
        params.setdefault("additionalProperties", False)
    return {"type": "object", "properties": {"name": {"const": tool["function"]["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False}, **defs}


def tool_grammar(fmt: ToolFormat, tools: list[dict], choice: str | dict, parallel: bool) -> Constraint:
    """A Lark grammar (llguidance's dialect) whose every sentence is `fmt`'s call format:
    one call of the named function, or for "required" one call of any tool (one or more
    unless parallel_tool_calls is false). Each tool is its own %json rule."""
    named = isinstance(choice, dict)
    allowed = [t for t in tools if t["function"]["name"] == _named(choice)][:1] if named else tools
    rules = [fmt.grammar(parallel and not named),
             "tool_body: " + " | ".join(f"tool_{i}" for i in range(len(allowed)))]
    rules += [f"tool_{i}: %json {json.dumps(call_schema(t, fmt.args_key))}" for i, t in enumerate(allowed)]
    return Constraint("lark", "\n".join(rules) + "\n")


# -- a request's plan -----------------------------------------------------------------------
@dataclass(frozen=True)
class ToolPlan:
    """How one chat request is served: tools rendered into the prompt, the format its output
    is read in (None: plain text) and the grammar that forces a call (None: free)."""

    tools: list[dict] | None = None
    fmt: ToolFormat | None = None
    constraint: Constraint | None = None

    def apply(self, params: SamplingParams) -> SamplingParams:
        if self.constraint is not None:
            params = replace(params, constraint=self.constraint)
        if self.fmt is not None and self.fmt.keep_special_tokens:
            params = replace(params, skip_special_tokens=False)  # the call marker is one
        return params


def plan_tools(parser: str | None, tools: list[dict] | None, choice: str | dict | None,
               parallel: bool | None) -> ToolPlan:
    """The plan of a request; 400 when its tools need a parser the server lacks."""
    if not tools:
        return ToolPlan()
    choice = choice or "auto"
    if choice == "none":
        return ToolPlan(tools)
    if parser is None:
        raise bad_request("`tools` is not supported: this server was started without --tool-call-parser "
                          f"(one of {', '.join(TOOL_CALL_PARSERS)}), so it cannot read tool calls")
    fmt = FORMATS[parser]
    if choice == "auto":
        return ToolPlan(tools, fmt)
    return ToolPlan(tools, fmt, tool_grammar(fmt, tools, choice, parallel is not False))
