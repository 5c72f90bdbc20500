"""What a stream writes: chunks from the template equal the pydantic models' JSON, byte for
byte, and deltas already queued go out in one write.

`server/openai_format.py` writes a plain text chunk (no logprobs, no tool calls) from a
per-response template instead of building and dumping the response models; the models stay
the definition of the format, so the two must agree on every text and finish reason."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from specserve.core.messages import GenerateReq, TokenOut
from specserve.core.sampling_params import SamplingParams
from specserve.server.fanout import FanOut
from specserve.server.openai_format import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatStream,
    CompletionChoice,
    CompletionResponse,
    CompletionStream,
    ResponseCtx,
)
from specserve.server.sse import sse_stream

TEXTS = ["", " hello", "é\n\t\x01\x7f\u2028 \"\\ 😀 </script>", "\x00\r\b\f", "中文 \ud7ff", " " * 3]
CASES = [(text, finished) for text in TEXTS for finished in (False, True)]


def _ctx(**kw) -> ResponseCtx:
    return ResponseCtx(id='cmpl-"q"\\é', model="org/model ü", created=1764412345, n=1, prompt_lens=[3],
                       tokenizer=None, **kw)


def _out(text: str, finished: bool) -> TokenOut:
    return TokenOut("r", [7], text, finished, {"type": "length"} if finished else None)


def _completion_chunk(ctx: ResponseCtx, index: int, text: str, finish: str | None) -> str:
    choice = CompletionChoice(index=index, text=text, logprobs=None, finish_reason=finish)
    return CompletionResponse(id=ctx.id, created=ctx.created, model=ctx.model, choices=[choice],
                              usage=None).model_dump_json()


def _chat_chunk(ctx: ResponseCtx, index: int, text: str, finish: str | None) -> str:
    delta = ChatDelta(content=text) if text or finish is None else ChatDelta()
    choice = ChatChunkChoice(index=index, delta=delta, logprobs=None, finish_reason=finish)
    return ChatCompletionChunk(id=ctx.id, created=ctx.created, model=ctx.model, choices=[choice],
                               usage=None).model_dump_json()


@pytest.mark.parametrize("text,finished", CASES)
@pytest.mark.parametrize("stream_cls,models,index", [(CompletionStream, _completion_chunk, 0),
                                                     (CompletionStream, _completion_chunk, 3),
                                                     (ChatStream, _chat_chunk, 0), (ChatStream, _chat_chunk, 2)])
def test_a_plain_chunk_is_the_models_json(text: str, finished: bool, stream_cls, models, index: int) -> None:
    ctx = _ctx()
    chunks = stream_cls(ctx, 4).delta(index, _out(text, finished))
    if not (text or finished):
        assert chunks == []  # nothing worth a chunk: the template is not asked
        return
    assert chunks == [models(ctx, index, text, "length" if finished else None)]


class _Burst:
    """An engine stream whose deltas are all there at once (the loop fell behind the engine)."""

    async def generate(self, req: GenerateReq) -> AsyncIterator[TokenOut]:
        for k in range(5):
            yield TokenOut(req.rid, [k], f" t{k}", k == 4, {"type": "length"} if k == 4 else None)

    def is_alive(self) -> bool:
        return True


def test_queued_deltas_go_out_in_one_write() -> None:
    async def writes() -> list[str]:
        fan = FanOut(_Burst(), [GenerateReq("r", [1, 2], SamplingParams(max_new_tokens=5))]).start()  # type: ignore[arg-type]
        first = await fan.next()
        await asyncio.sleep(0)  # the pump queues the other four
        return [w async for w in sse_stream(fan, first, CompletionStream(_ctx(), 1))]

    out = asyncio.run(writes())
    assert len(out) == 2 and out[1] == "data: [DONE]\n\n"
    events = [json.loads(e[len("data: "):]) for e in out[0].split("\n\n") if e]
    assert [e["choices"][0]["text"] for e in events] == [f" t{k}" for k in range(5)]
    assert [e["choices"][0]["finish_reason"] for e in events] == [None] * 4 + ["length"]
