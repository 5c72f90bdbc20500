"""SGLang's native endpoints: `POST /generate` and `GET /health_generate`.

Owns SGLang's request/response shape (`text`, `output_ids`, `meta_info` with every key the
engine reports, e.g. spec_verify_ct / spec_accept_length) so that scripts written against
SGLang's `/generate` work unchanged. Streaming sends cumulative text, as SGLang does.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request, Response

from specserve.core.messages import GenerateReq, TokenLogprob, TokenOut
from specserve.core.sampling_params import SamplingParams
from specserve.engine.protocol import EngineClient
from specserve.server import openapi
from specserve.server.errors import APIError, bad_request
from specserve.server.fanout import ChoiceState, ClientDisconnected, FanOut, collect, until_disconnected
from specserve.server.openai_routes import serve
from specserve.server.protocol import GenerateRequest, NativeSamplingParams
from specserve.server.validate import check_choices, parse_body, resolve_max_tokens, tokenize_prompt, validate_params

HEALTH_TIMEOUT_S = 20.0
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when sampling_params omits it


def _budget(client: EngineClient, body: GenerateRequest, prompt_len: int, param: str) -> int:
    """SGLang semantics: an explicit max_new_tokens must fit; the default shrinks to fit."""
    explicit = "max_new_tokens" in body.sampling_params.model_fields_set
    requested = body.sampling_params.max_new_tokens if explicit else None
    budget = resolve_max_tokens(client, prompt_len, requested, "prompt", (param, _NATIVE_NAMES["max_tokens"]))
    return budget if explicit else min(budget, DEFAULT_MAX_NEW_TOKENS)


def _rids(body: GenerateRequest, count: int) -> list[str]:
    if isinstance(body.rid, list):
        if len(body.rid) != count:
            raise bad_request(f"'rid' has {len(body.rid)} entries for {count} prompts", "rid")
        if len(set(body.rid)) != count:
            raise bad_request("'rid' has duplicate entries; each prompt needs its own id", "rid")
        return list(body.rid)
    base = body.rid or uuid.uuid4().hex
    return [base] if count == 1 else [f"{base}-{i}" for i in range(count)]


# SamplingParams' field names -> where they live in a /generate body.
_NATIVE_NAMES = {
    **{k: f"sampling_params.{k}" for k in NativeSamplingParams.model_fields},
    "max_tokens": "sampling_params.max_new_tokens",
    "top_logprobs": "top_logprobs_num",
    "constraint": "sampling_params",
}


def build_requests(client: EngineClient, body: GenerateRequest) -> list[GenerateReq]:
    param = "text" if body.text is not None else "input_ids"
    prompts = [tokenize_prompt(client, p, param) for p in body.prompts]
    rids = _rids(body, len(prompts))
    reqs = []
    for rid, ids in zip(rids, prompts):
        params: SamplingParams = body.to_sampling_params(_budget(client, body, len(ids), param))
        validate_params(client, params, _NATIVE_NAMES)
        reqs.append(GenerateReq(rid=rid, input_ids=ids, params=params))
    return reqs


def json_safe(value: Any) -> Any:
    """Non-finite floats (an -inf logprob, a 0/0 rate) become null: they are not JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _logprob_entries(client: EngineClient, lps: list[TokenLogprob], with_text: bool) -> dict[str, Any]:
    spell = (lambda t: client.tokenizer.token_str(t)) if with_text else (lambda t: None)
    return {
        "output_token_logprobs": [[lp.logprob, lp.token_id, spell(lp.token_id)] for lp in lps],
        "output_top_logprobs": [[[v, t, spell(t)] for t, v in lp.top] for lp in lps],
    }


class NativeView:
    """Builds SGLang-shaped outputs for one /generate call (final objects and stream events)."""

    def __init__(self, client: EngineClient, body: GenerateRequest, reqs: list[GenerateReq]):
        self.client = client
        self.body = body
        self.reqs = reqs
        self.t0 = time.perf_counter()
        self.states = [ChoiceState(i) for i in range(len(reqs))]

    def output(self, state: ChoiceState) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.reqs[state.index].rid,
            "prompt_tokens": state.prompt_tokens or len(self.reqs[state.index].input_ids),
            "completion_tokens": state.completion_tokens,
            "cached_tokens": state.cached_tokens,
            "finish_reason": state.finish_reason,
            "e2e_latency": time.perf_counter() - self.t0,
            **state.meta,
        }
        if self.body.return_logprob:
            meta.update(_logprob_entries(self.client, state.logprobs, self.body.return_text_in_logprobs))
        out = {"text": state.text, "output_ids": list(state.token_ids), "meta_info": json_safe(meta)}
        if self.body.is_batch and self.body.stream:
            out["index"] = state.index
        return out

    def final(self, states: list[ChoiceState]) -> Any:
        outputs = [self.output(s) for s in states]
        return outputs if self.body.is_batch else outputs[0]

    # StreamFormatter: cumulative text and ids, like SGLang's default streaming.
    def start(self) -> list[str]:
        return []

    def delta(self, index: int, out: TokenOut) -> list[str]:
        state = self.states[index]
        state.add(out)
        if not (out.text or out.token_ids or out.finished):
            return []
        return [json.dumps(self.output(state), ensure_ascii=False)]

    def end(self) -> list[str]:
        return []


async def health_generate(request: Request, client: EngineClient) -> Response:
    """Healthy only if the engine can run a real one-token generation in time."""
    ids = list(client.tokenizer.encode("ping", add_special_tokens=True)) or [0]
    req = GenerateReq(rid=f"health-{uuid.uuid4().hex}", input_ids=ids,
                      params=SamplingParams(max_new_tokens=1, temperature=0.0))
    fan = FanOut(client, [req]).start()
    try:
        await asyncio.wait_for(until_disconnected(request, collect(fan)), HEALTH_TIMEOUT_S)
    except (APIError, asyncio.TimeoutError, ClientDisconnected) as exc:
        detail = exc.message if isinstance(exc, APIError) else type(exc).__name__
        return APIError(503, f"Health check generation failed: {detail}").response()
    finally:
        await fan.close()
    return Response(status_code=200)


def make_native_router(client: EngineClient) -> APIRouter:
    router = APIRouter()

    @router.post("/generate", **openapi.GENERATE)
    async def generate(request: Request) -> Response:
        body = await parse_body(request, GenerateRequest)
        check_choices(client, len(body.prompts), 1, "text" if body.text is not None else "input_ids")
        reqs = await asyncio.to_thread(build_requests, client, body)  # tokenizing: off the event loop
        view = NativeView(client, body, reqs)
        return await serve(request, client, reqs, body.stream, view, view.final)

    @router.get("/health_generate", **openapi.HEALTH_GENERATE)
    async def health_gen(request: Request) -> Response:
        return await health_generate(request, client)

    return router
