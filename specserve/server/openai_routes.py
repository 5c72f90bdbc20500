"""`POST /v1/chat/completions` and `POST /v1/completions`.

Owns the request flow of the two OpenAI generation endpoints: parse -> check model ->
(chat: plan the tools, server/tool_calls.py) -> tokenize -> budget the context -> build and
validate `SamplingParams` -> fan out one engine request per choice -> answer as one JSON
object or as SSE chunks. Every check happens before the first engine request is submitted,
so a 4xx never leaves work behind.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from specserve.core.messages import GenerateReq
from specserve.core.sampling_params import SamplingParams
from specserve.engine.protocol import EngineClient
from specserve.server import openapi
from specserve.server.fanout import ChoiceState, ClientDisconnected, FanOut, collect, until_disconnected
from specserve.server.openai_format import ChatStream, CompletionStream, ResponseCtx, chat_response, completion_response
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest
from specserve.server.sse import SSEResponse, StreamFormatter, sse_stream
from specserve.server.tool_calls import PARAM_NAMES as TOOL_PARAM_NAMES
from specserve.server.tool_calls import plan_tools
from specserve.server.validate import (
    check_choices,
    check_model,
    parse_body,
    resolve_max_tokens,
    tokenize_chat,
    tokenize_prompt,
    validate_params,
)

CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the logs do


def fan_requests(client: EngineClient, rid: str, prompts: list[tuple[list[int], SamplingParams]],
                 n: int) -> list[GenerateReq]:
    """One engine request per choice: prompt p's choice j is choice p*n+j, rid `<rid>-<k>`.

    With a seed, choice j of each prompt samples with seed+j, so choice 0 matches the same
    request sent with n=1.
    """
    single = len(prompts) * n == 1
    reqs = []
    for p, (ids, base) in enumerate(prompts):
        for j in range(n):
            params = dataclasses.replace(
                base,
                seed=None if base.seed is None else base.seed + j,
                stop=list(base.stop),
                stop_token_ids=list(base.stop_token_ids),
            )
            validate_params(client, params)
            reqs.append(GenerateReq(rid=rid if single else f"{rid}-{p * n + j}", input_ids=list(ids), params=params))
    return reqs


async def serve(
    request: Request,
    client: EngineClient,
    reqs: list[GenerateReq],
    stream: bool,
    fmt: StreamFormatter,
    final: Callable[[list[ChoiceState]], Any],
) -> Response:
    """Submit `reqs` and answer: SSE through `fmt`, or `final(states)` (a JSON value) at once."""
    fan = FanOut(client, reqs).start()
    if stream:
        try:
            # Wait for the first delta before sending headers: an engine refusal is still a 4xx.
            first = await until_disconnected(request, fan.next())
        except ClientDisconnected:
            await fan.close()
            return Response(status_code=CLIENT_CLOSED)
        except BaseException:
            await fan.close()
            raise
        return SSEResponse(sse_stream(fan, first, fmt), fan.close)
    try:
        states = await until_disconnected(request, collect(fan))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        await fan.close()
    return JSONResponse(final(states))


async def chat_completions(request: Request, client: EngineClient) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    model = check_model(client, body.model)
    tools = plan_tools(client.config.server.tool_call_parser, body.tools, body.tool_choice, body.parallel_tool_calls)
    messages = [m.to_template() for m in body.messages]
    check_choices(client, 1, body.num_choices)
    template_vars = {} if tools.tools is None else {"tools": tools.tools}
    ids = await asyncio.to_thread(tokenize_chat, client, messages, **template_vars)  # off the event loop
    max_new = resolve_max_tokens(client, len(ids), body.requested_max_tokens(), "messages")
    base = tools.apply(body.to_sampling_params(max_new))
    names = TOOL_PARAM_NAMES if tools.constraint is not None else None
    if base.constraint is None:
        validate_params(client, base)
    else:  # compiling a grammar takes a while (the first one builds the compiler): off the event loop
        await asyncio.to_thread(validate_params, client, base, names)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    reqs = fan_requests(client, rid, [(ids, base)], body.num_choices)
    ctx = ResponseCtx(
        id=rid, model=model, created=int(time.time()), n=body.num_choices, prompt_lens=[len(ids)],
        tokenizer=client.tokenizer, logprobs=bool(body.logprobs), include_usage=body.include_usage,
        tool_format=tools.fmt,
    )
    final = lambda states: chat_response(ctx, states).model_dump(mode="json")  # noqa: E731
    return await serve(request, client, reqs, bool(body.stream), ChatStream(ctx, len(reqs)), final)


# Completions call the top-k count `logprobs`; SamplingParams calls it top_logprobs.
_COMPLETION_NAMES = {"top_logprobs": "logprobs"}


def _completion_prompts(client: EngineClient, body: CompletionRequest) -> list[tuple[list[int], SamplingParams]]:
    prompts = []
    for prompt in body.prompts:
        ids = tokenize_prompt(client, prompt, "prompt")
        base = body.to_sampling_params(resolve_max_tokens(client, len(ids), body.max_tokens, "prompt"))
        validate_params(client, base, _COMPLETION_NAMES)
        prompts.append((ids, base))
    return prompts


async def completions(request: Request, client: EngineClient) -> Response:
    body = await parse_body(request, CompletionRequest)
    model = check_model(client, body.model)
    check_choices(client, len(body.prompts), body.num_choices)
    prompts = await asyncio.to_thread(_completion_prompts, client, body)  # tokenizing: off the event loop
    rid = f"cmpl-{uuid.uuid4().hex}"
    reqs = fan_requests(client, rid, prompts, body.num_choices)
    ctx = ResponseCtx(
        id=rid, model=model, created=int(time.time()), n=body.num_choices,
        prompt_lens=[len(ids) for ids, _ in prompts], tokenizer=client.tokenizer,
        logprobs=body.logprobs is not None, include_usage=body.include_usage,
    )
    final = lambda states: completion_response(ctx, states).model_dump(mode="json")  # noqa: E731
    return await serve(request, client, reqs, bool(body.stream), CompletionStream(ctx, len(reqs)), final)


def make_openai_router(client: EngineClient) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions", **openapi.CHAT_COMPLETIONS)
    async def _chat(request: Request) -> Response:
        return await chat_completions(request, client)

    @router.post("/v1/completions", **openapi.COMPLETIONS)
    async def _completions(request: Request) -> Response:
        return await completions(request, client)

    return router
