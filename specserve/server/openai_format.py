"""Engine outputs -> OpenAI response objects: final responses, stream chunks, logprobs, usage.

Owns the mapping from `TokenOut`/`ChoiceState` to the shapes in `server/responses.py`,
for chat and for completions, streaming and not, tool calls included (read from the text
by server/tool_parsers.py). It knows nothing about HTTP or the engine beyond those output
types; the tokenizer is used only to spell token ids (`token_str`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from specserve.core.messages import TokenLogprob, TokenOut
from specserve.server.fanout import ChoiceState, finish_reason_str
from specserve.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FunctionCall,
    FunctionDelta,
    PromptTokensDetails,
    TokenLogprobOut,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from specserve.server.tool_parsers import ToolFormat, ToolStream, split

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


@dataclass(frozen=True)
class ResponseCtx:
    """What every chunk of one HTTP response shares."""

    id: str
    model: str
    created: int
    n: int  # choices per prompt; choice k belongs to prompt k // n
    prompt_lens: list[int]
    tokenizer: Any
    logprobs: bool = False
    include_usage: bool = False
    tool_format: ToolFormat | None = None  # chat: the output is read for tool calls in this format


def _clamp(logprob: float) -> float:
    return logprob if not math.isnan(logprob) and logprob > MIN_LOGPROB else MIN_LOGPROB


def make_usage(ctx: ResponseCtx, states: list[ChoiceState]) -> Usage:
    """Prompt tokens count once per prompt (not per choice), as OpenAI and vLLM do."""
    prompt = sum(ctx.prompt_lens)
    completion = sum(s.completion_tokens for s in states)
    cached = sum(
        max((s.cached_tokens for s in states[p * ctx.n : (p + 1) * ctx.n]), default=0)
        for p in range(len(ctx.prompt_lens))
    )
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _top(tokenizer: Any, token_id: int, logprob: float) -> TopLogprob:
    text = tokenizer.token_str(token_id)
    return TopLogprob(token=text, logprob=_clamp(logprob), bytes=list(text.encode("utf-8")))


def chat_logprobs(tokenizer: Any, logprobs: list[TokenLogprob]) -> ChatLogprobs:
    content = []
    for lp in logprobs:
        head = _top(tokenizer, lp.token_id, lp.logprob)
        tops = [_top(tokenizer, tid, tlp) for tid, tlp in lp.top]
        content.append(TokenLogprobOut(**head.model_dump(), top_logprobs=tops))
    return ChatLogprobs(content=content)


def completion_logprobs(tokenizer: Any, logprobs: list[TokenLogprob], offset: int) -> tuple[CompletionLogprobs, int]:
    """Legacy completions logprobs; `offset` is where the first token starts in the choice text."""
    out = CompletionLogprobs()
    for lp in logprobs:
        text = tokenizer.token_str(lp.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(_clamp(lp.logprob))
        out.top_logprobs.append({tokenizer.token_str(t): _clamp(v) for t, v in lp.top})
        out.text_offset.append(offset)
        offset += len(text)
    return out, offset


def _message(ctx: ResponseCtx, state: ChoiceState) -> tuple[AssistantMessage, str | None]:
    """The choice's message and finish_reason ("tool_calls" when calls were read)."""
    reason = finish_reason_str(state.finish_reason)
    if ctx.tool_format is None:
        return AssistantMessage(content=state.text), reason
    content, calls = split(ctx.tool_format, state.text)
    if not calls:
        return AssistantMessage(content=content), reason
    out = [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
    return AssistantMessage(content=content, tool_calls=out), "tool_calls"


def chat_response(ctx: ResponseCtx, states: list[ChoiceState]) -> ChatCompletionResponse:
    choices = []
    for s in states:
        message, reason = _message(ctx, s)
        choices.append(ChatChoice(index=s.index, message=message, finish_reason=reason,
                                  logprobs=chat_logprobs(ctx.tokenizer, s.logprobs) if ctx.logprobs else None))
    return ChatCompletionResponse(id=ctx.id, created=ctx.created, model=ctx.model, choices=choices,
                                  usage=make_usage(ctx, states))


def completion_response(ctx: ResponseCtx, states: list[ChoiceState]) -> CompletionResponse:
    choices = [
        CompletionChoice(
            index=s.index,
            text=s.text,
            logprobs=completion_logprobs(ctx.tokenizer, s.logprobs, 0)[0] if ctx.logprobs else None,
            finish_reason=finish_reason_str(s.finish_reason),
        )
        for s in states
    ]
    return CompletionResponse(id=ctx.id, created=ctx.created, model=ctx.model, choices=choices,
                              usage=make_usage(ctx, states))


def _js(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class _StreamBase:
    """A stream's bookkeeping, and its plain chunks written from a template.

    Most chunks carry text and nothing else; building and dumping the pydantic models for
    each costs several times what the template does, for the same JSON text
    (tests/unit/test_stream_chunks.py holds the two equal)."""

    OBJECT = ""

    def __init__(self, ctx: ResponseCtx, num_choices: int):
        self.ctx = ctx
        self.states = [ChoiceState(i) for i in range(num_choices)]
        self._head = (f'{{"id":{_js(ctx.id)},"object":"{self.OBJECT}","created":{ctx.created},'
                      f'"model":{_js(ctx.model)},"choices":[{{"index":')

    def _plain(self, index: int, body: str, finish: str | None) -> str:
        """A chunk of one choice whose fields after `index` are `body` (JSON members),
        no logprobs, and `finish`."""
        return f'{self._head}{index},{body},"logprobs":null,"finish_reason":{_js(finish)}}}],"usage":null}}'

    def _track(self, index: int, out: TokenOut) -> bool:
        """Record `out`; False when it carries nothing worth a chunk (e.g. held-back text)."""
        self.states[index].add(out)
        return bool(out.text or out.finished or (self.ctx.logprobs and out.logprobs))

    def _finish(self, out: TokenOut) -> str | None:
        return finish_reason_str(out.finish_reason or {"type": "stop"}) if out.finished else None


class ChatStream(_StreamBase):
    """Chunks of /v1/chat/completions: a role delta per choice, content deltas, usage last.

    With a tool format, each choice's text goes through a `ToolStream`: content streams as
    it is known not to start a call, and each call goes out whole as two tool_calls deltas
    (index, id, type and name; then its arguments)."""

    OBJECT = "chat.completion.chunk"

    def __init__(self, ctx: ResponseCtx, num_choices: int):
        super().__init__(ctx, num_choices)
        fmt = ctx.tool_format
        self._splitters = None if fmt is None else [ToolStream(fmt) for _ in range(num_choices)]

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        c = self.ctx
        chunk = ChatCompletionChunk(id=c.id, created=c.created, model=c.model, choices=choices, usage=usage)
        return chunk.model_dump_json()

    def start(self) -> list[str]:
        return [self._chunk([ChatChunkChoice(index=s.index, delta=ChatDelta(role="assistant", content=""))])
                for s in self.states]

    def delta(self, index: int, out: TokenOut) -> list[str]:
        if not self._track(index, out):
            return []
        lps = chat_logprobs(self.ctx.tokenizer, out.logprobs) if self.ctx.logprobs else None
        finish = self._finish(out)
        if self._splitters is None and lps is None:
            delta = f'{{"content":{_js(out.text)}}}' if out.text or not out.finished else "{}"
            return [self._plain(index, f'"delta":{delta}', finish)]
        if self._splitters is None:
            deltas = [ChatDelta(content=out.text) if out.text or not out.finished else ChatDelta()]
        else:
            deltas, called = self._tool_deltas(self._splitters[index], out)
            finish = "tool_calls" if finish is not None and called else finish
            if not deltas and not lps and finish is None:
                return []  # held back: it may be the start of a call
            deltas = deltas or [ChatDelta()]
        last = len(deltas) - 1
        return [self._chunk([ChatChunkChoice(index=index, delta=d, logprobs=lps if k == 0 else None,
                                             finish_reason=finish if k == last else None)])
                for k, d in enumerate(deltas)]

    @staticmethod
    def _tool_deltas(stream: ToolStream, out: TokenOut) -> tuple[list[ChatDelta], bool]:
        """The deltas of `out.text` through the choice's splitter; True once a call was read."""
        first = stream.calls  # the index of the next call
        pieces = stream.feed(out.text) + (stream.finish() if out.finished else [])
        deltas: list[ChatDelta] = []
        for piece in pieces:
            if isinstance(piece, str):
                if piece:
                    deltas.append(ChatDelta(content=piece))
                continue
            head = ToolCallDelta(index=first, id=piece.id, type="function",
                                 function=FunctionDelta(name=piece.name, arguments=""))
            args = ToolCallDelta(index=first, function=FunctionDelta(arguments=piece.arguments))
            deltas += [ChatDelta(tool_calls=[head]), ChatDelta(tool_calls=[args])]
            first += 1
        return deltas, stream.calls > 0

    def end(self) -> list[str]:
        return [self._chunk([], make_usage(self.ctx, self.states))] if self.ctx.include_usage else []


class CompletionStream(_StreamBase):
    """Chunks of /v1/completions: text deltas per choice, usage last."""

    OBJECT = "text_completion"

    def __init__(self, ctx: ResponseCtx, num_choices: int):
        super().__init__(ctx, num_choices)
        self._offsets = [0] * num_choices

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        c = self.ctx
        chunk = CompletionResponse(id=c.id, created=c.created, model=c.model, choices=choices, usage=usage)
        return chunk.model_dump_json()

    def start(self) -> list[str]:
        return []

    def delta(self, index: int, out: TokenOut) -> list[str]:
        if not self._track(index, out):
            return []
        if not self.ctx.logprobs:
            return [self._plain(index, f'"text":{_js(out.text)}', self._finish(out))]
        lps, self._offsets[index] = completion_logprobs(self.ctx.tokenizer, out.logprobs, self._offsets[index])
        choice = CompletionChoice(index=index, text=out.text, logprobs=lps, finish_reason=self._finish(out))
        return [self._chunk([choice])]

    def end(self) -> list[str]:
        return [self._chunk([], make_usage(self.ctx, self.states))] if self.ctx.include_usage else []
