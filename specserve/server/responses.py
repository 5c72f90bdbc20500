"""Response bodies of the OpenAI-compatible API (pydantic v2), final objects and stream chunks.

Owns the wire shape of what we send back, field for field as the official `openai` client
parses it. Building them from engine outputs is `server/openai_format.py`'s job; the
native `/generate` shape is SGLang's free-form dict, built in `server/native_routes.py`, and
`GenerateOutput` here only documents it (for `/openapi.json`). `ErrorResponse` is the one error
body of every route (`server/errors.py`'s `APIError.body()`).
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


# -- chat -------------------------------------------------------------------------------------
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut] = Field(default_factory=list)


class _NoNulls(BaseModel):
    """Serialized without its None fields: OpenAI leaves such keys out of stream deltas."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the message is only tool calls
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _calls_if_any(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionDelta(_NoNulls):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_NoNulls):
    """A piece of call `index`: the first carries id, type and name, later ones arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class ChatDelta(_NoNulls):
    # OpenAI sends {"role": ...} once and then {"content": ...}: absent, not null.
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# -- completions ------------------------------------------------------------------------------
class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Also the stream chunk shape: OpenAI uses object "text_completion" for both."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# -- models -----------------------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "specserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- errors -----------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str  # invalid_request_error, authentication_error, not_found_error, ...
    param: str | None  # the offending field, e.g. "messages[0].content"
    code: int  # the HTTP status


class ErrorResponse(BaseModel):
    """What every 4xx/5xx answers, OpenAI's shape: `{"error": {...}}`."""

    error: ErrorDetail


# -- admin and native routes (documentation: the routes build these as dicts) -----------------
class ServedModelInfo(BaseModel):
    model_path: str
    tokenizer_path: str
    served_model_name: str
    context_length: int
    is_generation: bool


class FlushCacheResult(BaseModel):
    success: bool
    message: str


class GenerateMetaInfo(BaseModel):
    """SGLang's meta_info: these keys always, plus whatever the engine reports
    (spec_verify_ct, spec_accept_length, logprob lists, ...)."""

    model_config = ConfigDict(extra="allow")

    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: dict[str, Any] | None  # {"type": "length" | "stop" | ..., ...}; null while streaming
    e2e_latency: float | None


class GenerateOutput(BaseModel):
    """One prompt's result from /generate (a batch answers a list of them)."""

    text: str
    output_ids: list[int]
    meta_info: GenerateMetaInfo
    index: int | None = None  # only in a batch's stream events: which prompt this one is
