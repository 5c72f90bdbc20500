"""Request bodies of the HTTP API (pydantic v2) and their mapping onto `SamplingParams`.

Owns the wire shape of what clients send: the OpenAI `ChatCompletionRequest` and
`CompletionRequest`, and SGLang's native `GenerateRequest`. Validation here is about
*types and shapes* (strict: a known field of the wrong type is an error; unknown fields are
ignored because OpenAI clients send extras). Value ranges that need the model (vocab size,
context length) are checked later by `SamplingParams.validate` and `server/validate.py`.
Where a validator admits less than its type says (no empty prompt, content or tool calls), a
`WithJsonSchema` or `json_schema_extra` next to it says so in `/openapi.json`.
Response bodies live in `server/responses.py`.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, cast

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.config import JsonDict

from specserve.core.sampling_params import Constraint, SamplingParams
from specserve.server.tool_calls import (
    check_message_tool_calls,
    check_tool_choice,
    check_tool_choice_fits,
    check_tools,
)

MAX_N = 16
ROLES = ("system", "developer", "user", "assistant", "tool")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_prompt(value: Any) -> Any:
    """Accept str | list[str] | list[int] | list[list[int]], nothing empty; explain failures.

    Checking the shape ourselves gives one clear message instead of pydantic's per-union-member
    error list.
    """
    shape = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(value, str):
        if not value:
            raise ValueError("prompt must not be empty")
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(f"must be {shape} (and not empty)" if value == [] else f"must be {shape}")
    if all(isinstance(x, str) for x in value):
        if not all(value):
            raise ValueError("prompts must not be empty strings")
    elif all(_is_int(x) for x in value):
        pass
    elif all(isinstance(x, list) for x in value):
        if not all(x and all(_is_int(t) for t in x) for x in value):
            raise ValueError("each token-id prompt must be a non-empty list of integers")
    else:
        raise ValueError(f"must be {shape}")
    return value


def _check_stop(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ValueError("must be a string or a list of strings")


# The JSON schema of what _check_prompt admits (pydantic's own would admit empty prompts).
_TEXT = {"type": "string", "minLength": 1}
_TEXTS = {"type": "array", "items": _TEXT, "minItems": 1}
_TOKENS = {"type": "array", "items": {"type": "integer"}, "minItems": 1}
_TOKEN_LISTS = {"type": "array", "items": _TOKENS, "minItems": 1}
_NULL = {"type": "null"}

PromptInput = Annotated[str | list[str] | list[int] | list[list[int]], BeforeValidator(_check_prompt),
                        WithJsonSchema({"anyOf": [_TEXT, _TEXTS, _TOKENS, _TOKEN_LISTS]})]
StopInput = Annotated[str | list[str] | None, BeforeValidator(_check_stop)]
# /generate splits PromptInput in two (GenerateRequest._one_input); the schema says which is which.
TextInput = Annotated[PromptInput | None, WithJsonSchema({"anyOf": [_TEXT, _TEXTS, _NULL]})]
IdsInput = Annotated[PromptInput | None, WithJsonSchema({"anyOf": [_TOKENS, _TOKEN_LISTS, _NULL]})]


def prompt_list(value: str | list[str] | list[int] | list[list[int]]) -> list[str] | list[list[int]]:
    """Normalize a prompt field to a batch: one entry per prompt."""
    if isinstance(value, str):
        return [value]
    # `_check_prompt` admitted only homogeneous lists, so the first item tells which one this is.
    if _is_int(value[0]):
        return [cast("list[int]", list(value))]
    return cast("list[str] | list[list[int]]", list(value))


def stop_list(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = False


# Fields that would change the output if honoured: refused loudly rather than ignored.
# Each maps to the value that means "not used".
UNSUPPORTED_FIELDS: dict[str, tuple[object, ...]] = {
    "functions": (None, []), "best_of": (None, 1), "guided_grammar": (None,), "guided_choice": (None,)}


def _refuse_unsupported(data: Any) -> Any:
    if isinstance(data, dict):
        for name, neutral in UNSUPPORTED_FIELDS.items():
            if name in data and data[name] not in neutral:
                raise ValueError(f"`{name}` is not supported by specserve yet")
    return data


def _json_text(value: Any, what: str) -> str:
    """A JSON schema given as an object or as its serialized text, serialized."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, dict | bool):
        raise ValueError(f"{what} must be a JSON object")
    return json.dumps(value)


def response_constraint(fmt: dict | None) -> Constraint | None:
    """OpenAI's `response_format` as a grammar constraint (None for text)."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError("response_format of type json_schema needs a `json_schema` object with a `schema`")
        return Constraint("json_schema", _json_text(spec["schema"], "response_format.json_schema.schema"))
    raise ValueError(f"response_format type must be one of text, json_object, json_schema; got {kind!r}")


def one_constraint(**given: Any) -> Constraint | None:
    """The one constraint among the given kinds (None when none is set); two is an error."""
    set_ = {k: v for k, v in given.items() if v is not None}
    if len(set_) > 1:
        raise ValueError(f"at most one of {', '.join(given)} may be given, got {', '.join(set_)}")
    if not set_:
        return None
    kind, value = next(iter(set_.items()))
    if isinstance(value, Constraint):
        return value
    if kind in ("json_schema", "guided_json"):
        return Constraint("json_schema", _json_text(value, kind))
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind} must be a non-empty string")
    return Constraint("regex" if kind in ("regex", "guided_regex") else kind, value)


def bias_map(value: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as strings) as {id: bias}; ranges are checked with the
    vocabulary (SamplingParams.validate)."""
    out: dict[int, float] = {}
    for key, bias in (value or {}).items():
        try:
            out[int(key)] = float(bias)
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids (integers as strings), got {key!r}") from None
    return out


class _OpenAIBase(_Strict):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        return _refuse_unsupported(data)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = Field(1, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: StopInput = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    user: str | None = None

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def constraint(self) -> Constraint | None:
        """The grammar the output must match (response_format, or vLLM's guided_* fields)."""
        return one_constraint(response_format=response_constraint(self.response_format),
                              guided_json=self.guided_json, guided_regex=self.guided_regex)

    @model_validator(mode="after")
    def _processors_parse(self) -> _OpenAIBase:
        self.constraint()  # raises ValueError naming the problem: a 400 from parse_body
        bias_map(self.logit_bias)
        return self

    def _sampling(self, max_new_tokens: int, logprobs: bool, top_logprobs: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=bias_map(self.logit_bias),
            constraint=self.constraint(),
            stop=stop_list(self.stop),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            seed=self.seed,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            skip_special_tokens=self.skip_special_tokens is not False,
        )


def _flatten_content(value: Any) -> Any:
    """OpenAI content is a string or a list of parts; only text parts exist for a text model.

    Flattened here (parts joined by newlines, as vLLM does) so everything downstream sees a str.
    """
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of content parts")
    texts = []
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"only text content parts ({{'type': 'text', 'text': ...}}) are supported, got {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


_TEXT_PART = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
              "required": ["type", "text"]}
CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]}
_FUNCTION: JsonDict = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
_CALL: JsonDict = {"type": "object", "required": ["function"], "properties": {"function": _FUNCTION}}
# What ChatMessage's validators admit, for the schema: content, or an assistant's tool calls (or both).
_MESSAGE_RULES: JsonDict = {"allOf": [
    {"anyOf": [{"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
               {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]},
    {"anyOf": [{"properties": {"tool_calls": {"type": "null"}}},
               {"properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "items": _CALL}}}]},
]}


class ChatMessage(_Strict):
    model_config = ConfigDict(json_schema_extra=_MESSAGE_RULES)

    role: str = Field(json_schema_extra={"enum": list(ROLES)})
    # before content: content's validator reads them (an assistant's tool calls may stand alone)
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    content: Annotated[str | None, BeforeValidator(_flatten_content), WithJsonSchema(CONTENT_SCHEMA)] = Field(
        None, validate_default=True)
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"'{role}' is not a valid role; expected one of {', '.join(ROLES)}")
        return role

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _tool_calls(cls, value: Any, info: ValidationInfo) -> list[dict] | None:
        return check_message_tool_calls(value, info.data.get("role"))

    @field_validator("content")
    @classmethod
    def _has_content(cls, content: str | None, info: ValidationInfo) -> str | None:
        if content is None and not info.data.get("tool_calls"):
            raise ValueError("every message needs a 'content' (a string or a list of text parts), "
                             "except an assistant message with tool_calls")
        return content

    def to_template(self) -> dict[str, Any]:
        """The dict a chat template expects: role and plain-text content (and name, an
        assistant's tool_calls, a tool result's tool_call_id, if given)."""
        msg: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.name:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class ChatCompletionRequest(_OpenAIBase):
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: Annotated[list[dict] | None, BeforeValidator(check_tools)] = None
    tool_choice: Annotated[str | dict | None, BeforeValidator(check_tool_choice)] = None
    parallel_tool_calls: bool | None = None

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("messages must contain at least one message")
        return messages

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _tool_choice_fits(self) -> ChatCompletionRequest:
        check_tool_choice_fits(self.tools, self.tool_choice, self.constraint() is not None)
        return self

    def requested_max_tokens(self) -> int | None:
        # OpenAI's newer name wins when both are given.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_new_tokens: int) -> SamplingParams:
        return self._sampling(max_new_tokens, bool(self.logprobs), self.top_logprobs or 0)


class CompletionRequest(_OpenAIBase):
    prompt: PromptInput
    logprobs: int | None = Field(None, ge=0)
    echo: bool | None = False
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool | None) -> bool | None:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix is not None:
            raise ValueError("suffix is not supported")
        return suffix

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        return prompt_list(self.prompt)

    def to_sampling_params(self, max_new_tokens: int) -> SamplingParams:
        # Completions' `logprobs: k` means "logprobs of the sampled tokens plus the top k".
        return self._sampling(max_new_tokens, self.logprobs is not None, self.logprobs or 0)


class NativeSamplingParams(_Strict):
    """SGLang's `sampling_params` names; SGLang's defaults (notably max_new_tokens=128)."""

    # Defaults passed as `default=`: type checkers read only that keyword as a field's default.
    max_new_tokens: int | None = Field(default=128, ge=0)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    stop: StopInput = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = Field(default=None, validation_alias=AliasChoices("seed", "sampling_seed"))

    @model_validator(mode="after")
    def _processors_parse(self) -> NativeSamplingParams:
        one_constraint(json_schema=self.json_schema, regex=self.regex, ebnf=self.ebnf)
        bias_map(self.logit_bias)
        return self


class GenerateRequest(_Strict):
    text: TextInput = None
    input_ids: IdsInput = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0)
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of 'text' or 'input_ids' must be given")
        if isinstance(self.text, list) and self.text and not isinstance(self.text[0], str):
            raise ValueError("'text' must be a string or a list of strings; use 'input_ids' for token ids")
        if isinstance(self.input_ids, str) or (self.input_ids and isinstance(self.input_ids[0], str)):
            raise ValueError("'input_ids' must be a list of token ids (or a list of such lists)")
        return self

    @property
    def is_batch(self) -> bool:
        value = self.text if self.text is not None else self.input_ids
        return isinstance(value, list) and (self.text is not None or isinstance(value[0], list))

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        value = self.text if self.text is not None else self.input_ids
        assert value is not None, "_one_input admits exactly one of text / input_ids"
        return prompt_list(value)

    def to_sampling_params(self, max_new_tokens: int | None) -> SamplingParams:
        sp = self.sampling_params
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            min_p=sp.min_p,
            frequency_penalty=sp.frequency_penalty,
            presence_penalty=sp.presence_penalty,
            repetition_penalty=sp.repetition_penalty,
            logit_bias=bias_map(sp.logit_bias),
            constraint=one_constraint(json_schema=sp.json_schema, regex=sp.regex, ebnf=sp.ebnf),
            stop=stop_list(sp.stop),
            stop_token_ids=list(sp.stop_token_ids or []),
            ignore_eos=sp.ignore_eos,
            seed=sp.seed,
            logprobs=self.return_logprob,
            top_logprobs=self.top_logprobs_num if self.return_logprob else 0,
            skip_special_tokens=sp.skip_special_tokens,
        )
