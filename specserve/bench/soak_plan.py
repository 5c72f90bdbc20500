"""What a soak client sends: one random request (or a pair sharing a rid) at a time.

Owns the request mix of `specserve bench soak`: the route, the prompt, max_tokens, the
sampling parameters, streaming or not, whether the client hangs up early, and the greedy
reference requests whose answers must not change under load. Pure: a `random.Random` in, a
`Plan` out, so a seed replays a client's sequence of bodies. It knows nothing about HTTP.

Invariant: a reference request (greedy, `reference` set) has exactly the body the idle server
answered, except `stream` and `n`, which do not change a greedy answer; each of its choices
must equal the idle answer.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from specserve.bench.prompts import mt_bench_first_turns
from specserve.bench.repetitive import repetitive_prompts

CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"
ROUTES = (CHAT, COMPLETIONS, GENERATE)
STOP_STRINGS = ("\n\n", ".", " and", "2", "```")


@dataclass(frozen=True)
class Mix:
    """The shares of a soak's requests, and their sizes."""

    disconnect_share: float = 0.1  # hang up before the end (streaming: after a few events)
    duplicate_share: float = 0.05  # a /generate pair sharing one rid, the second sent mid-stream
    greedy_share: float = 0.15  # a greedy reference request, compared with the idle answer
    max_tokens: int = 64  # random max_tokens are drawn from 1..max_tokens
    greedy_max_tokens: int = 24  # every reference request's max_tokens
    greedy_prompts: int = 4  # reference prompts (each asked on every route)


@dataclass(frozen=True)
class Plan:
    """One HTTP request to make, and what its answer must look like."""

    route: str
    body: dict[str, Any]
    kind: str  # "random" | "greedy" | "first" / "second" (the two of a duplicate-rid pair)
    choices: int = 1  # choices the answer must carry (n, or prompts of a /generate batch)
    reference: int | None = None  # index of the greedy reference prompt this must reproduce
    close_after_events: int | None = None  # streaming: hang up after this many data events
    close_after_s: float | None = None  # not streaming: hang up after this long

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def prompt_pool() -> list[str]:
    """The bundled prompts: MT-bench first turns and the repeat/edit-code set."""
    return mt_bench_first_turns() + repetitive_prompts()


def reference_prompts(pool: list[str], count: int) -> list[str]:
    """`count` prompts spread over the pool (fixed: the same every run)."""
    return [pool[i * len(pool) // count] for i in range(count)]


def body_for(route: str, prompt: str | list[str], max_tokens: int, params: dict[str, Any],
             stream: bool) -> dict[str, Any]:
    """The request body of `route` for a prompt (a list: a /generate batch) and OpenAI-named params."""
    if route == GENERATE:
        native = {("max_new_tokens" if k == "max_tokens" else k): v for k, v in params.items() if k != "n"}
        return {"text": prompt, "stream": stream, "sampling_params": {"max_new_tokens": max_tokens, **native}}
    body: dict[str, Any] = {"max_tokens": max_tokens, "stream": stream, **params}
    if route == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def reference_body(route: str, prompt: str, max_tokens: int, stream: bool = False, n: int = 1) -> dict[str, Any]:
    """A greedy reference request: temperature 0, a fixed length (ignore_eos: always max_tokens)."""
    params: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}
    if n > 1:
        params["n"] = n
    return body_for(route, prompt, max_tokens, params, stream)


def random_params(rng: random.Random, route: str) -> dict[str, Any]:
    """Sampling parameters, each present or not; OpenAI names (body_for maps them for /generate)."""
    p: dict[str, Any] = {"temperature": rng.choice((0.0, 0.5, 0.8, 1.0, 1.3))}
    if rng.random() < 0.5:
        p["top_p"] = rng.choice((0.5, 0.8, 0.95, 1.0))
    if rng.random() < 0.4:
        p["top_k"] = rng.choice((1, 5, 20, 50))
    if rng.random() < 0.3:
        p["min_p"] = rng.choice((0.02, 0.1, 0.2))
    if rng.random() < 0.5:
        p["seed"] = rng.randrange(2**31)
    if rng.random() < 0.3:
        p["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 2))
    if rng.random() < 0.15:
        p[rng.choice(("frequency_penalty", "presence_penalty"))] = rng.choice((-0.5, 0.5, 1.0))
    if rng.random() < 0.15:
        p["repetition_penalty"] = rng.choice((0.9, 1.1, 1.3))
    if rng.random() < 0.2:
        p["ignore_eos"] = True
    if route != GENERATE and rng.random() < 0.3:
        p["n"] = 2
    return p


def _hang_up(rng: random.Random, mix: Mix, stream: bool) -> dict[str, Any]:
    if rng.random() >= mix.disconnect_share:
        return {}
    if stream:
        return {"close_after_events": rng.randint(1, 4)}
    return {"close_after_s": rng.uniform(0.05, 1.0)}


def random_plan(rng: random.Random, mix: Mix, pool: list[str]) -> Plan:
    route, stream = rng.choice(ROUTES), rng.random() < 0.6
    params = random_params(rng, route)
    if stream and route != GENERATE and rng.random() < 0.5:
        params["stream_options"] = {"include_usage": True}
    max_tokens = rng.randint(1, mix.max_tokens)
    prompt: str | list[str] = rng.choice(pool)
    choices = int(params.get("n", 1))
    if route == GENERATE and rng.random() < 0.2:
        prompt, choices = rng.sample(pool, 2), 2  # a batch of two prompts
    body = body_for(route, prompt, max_tokens, params, stream)
    return Plan(route, body, "random", choices=choices, **_hang_up(rng, mix, stream))


def greedy_plan(rng: random.Random, mix: Mix, refs: list[str]) -> Plan:
    route, stream, index = rng.choice(ROUTES), rng.random() < 0.5, rng.randrange(len(refs))
    n = 2 if route != GENERATE and rng.random() < 0.3 else 1
    body = reference_body(route, refs[index], mix.greedy_max_tokens, stream, n)
    return Plan(route, body, "greedy", choices=n, reference=index)


def duplicate_pair(rng: random.Random, mix: Mix, refs: list[str], rid: str) -> tuple[Plan, Plan]:
    """Two greedy /generate requests with one rid: the first streams, the second is sent once
    the first's first event arrived, so it finds the rid in flight (409). Their prompts differ,
    so the served one carrying the other's tokens would not match its reference."""
    first, second = rng.sample(range(len(refs)), 2) if len(refs) > 1 else (0, 0)
    a = reference_body(GENERATE, refs[first], mix.greedy_max_tokens, stream=True)
    b = reference_body(GENERATE, refs[second], mix.greedy_max_tokens, stream=rng.random() < 0.5)
    return (Plan(GENERATE, {**a, "rid": rid}, "first", reference=first),
            Plan(GENERATE, {**b, "rid": rid}, "second", reference=second))


def draw(rng: random.Random, mix: Mix, pool: list[str], refs: list[str], rid: str) -> list[Plan]:
    """A client's next turn: one request, or a duplicate-rid pair (rid: unique to this turn)."""
    roll = rng.random()
    if roll < mix.duplicate_share:
        return list(duplicate_pair(rng, mix, refs, rid))
    if roll < mix.duplicate_share + mix.greedy_share:
        return [greedy_plan(rng, mix, refs)]
    return [random_plan(rng, mix, pool)]
