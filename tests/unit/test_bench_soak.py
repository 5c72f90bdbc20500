"""`specserve bench soak`'s pure parts: the request mix (every body it draws is one the server
accepts), reading answers, /proc and /metrics parsing, and each check's verdict.
The soak itself, against a real server, is tests/e2e/test_soak.py."""
from __future__ import annotations

import random

import pytest

from specserve.bench import soak_checks as checks
from specserve.bench.soak_client import Outcome, read_choices
from specserve.bench.soak_plan import (
    CHAT,
    COMPLETIONS,
    GENERATE,
    Mix,
    draw,
    duplicate_pair,
    greedy_plan,
    prompt_pool,
    reference_body,
    reference_prompts,
)
from specserve.bench.soak_server import Memory, descendants, parse_gauges, parse_stat, parse_status_kb
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest

MODELS = {CHAT: ChatCompletionRequest, COMPLETIONS: CompletionRequest, GENERATE: GenerateRequest}
VOCAB = 49152


BUSY = Mix(duplicate_share=0.2, greedy_share=0.2, disconnect_share=0.3)


def _plans(seed: int, turns: int, mix: Mix = BUSY):
    rng, pool = random.Random(seed), prompt_pool()
    refs = reference_prompts(pool, mix.greedy_prompts)
    return [p for t in range(turns) for p in draw(rng, mix, pool, refs, rid=f"r{t}")]


def test_every_drawn_body_is_one_the_server_accepts():
    plans = _plans(0, 600)
    assert {p.route for p in plans} == set(MODELS) and {p.kind for p in plans} == {"random", "greedy", "first", "second"}
    assert any(p.stream for p in plans) and any(not p.stream for p in plans)
    assert any(p.close_after_events for p in plans) and any(p.close_after_s for p in plans)
    for plan in plans:
        body = MODELS[plan.route].model_validate(plan.body)
        params = body.to_sampling_params(plan.body.get("max_tokens", 8))
        params.validate(VOCAB)
        n = getattr(body, "num_choices", 1) * len(body.prompts if plan.route != CHAT else [0])
        assert n == plan.choices <= 2


def test_a_seed_replays_the_same_requests():
    assert [p.body for p in _plans(7, 50)] == [p.body for p in _plans(7, 50)]
    assert [p.body for p in _plans(7, 50)] != [p.body for p in _plans(8, 50)]


def test_greedy_requests_repeat_the_reference_body_but_for_stream_and_n():
    mix, refs = Mix(), reference_prompts(prompt_pool(), 4)
    rng = random.Random(1)
    for _ in range(50):
        plan = greedy_plan(rng, mix, refs)
        assert plan.reference is not None
        want = reference_body(plan.route, refs[plan.reference], mix.greedy_max_tokens)
        strip = {"stream", "n"}
        assert {k: v for k, v in plan.body.items() if k not in strip} == {k: v for k, v in want.items() if k not in strip}
        assert plan.close_after_events is None and plan.close_after_s is None


def test_a_duplicate_pair_shares_its_rid_and_not_its_prompt():
    first, second = duplicate_pair(random.Random(2), Mix(), reference_prompts(prompt_pool(), 4), "rid-9")
    assert first.body["rid"] == second.body["rid"] == "rid-9"
    assert first.route == second.route == GENERATE and first.stream
    assert first.reference != second.reference and first.body["text"] != second.body["text"]
    assert (first.kind, second.kind) == ("first", "second")


def test_read_choices_per_route():
    out = Outcome(CHAT, "random", True, choices=2)
    for chunk in ({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
                  {"choices": [{"index": 1, "delta": {"content": "a"}, "finish_reason": None}]},
                  {"choices": [{"index": 0, "delta": {"content": "b"}, "finish_reason": "stop"}]},
                  {"choices": [{"index": 1, "delta": {"content": "c"}, "finish_reason": "length"}]},
                  {"choices": [], "usage": {"completion_tokens": 3}}):
        read_choices(CHAT, chunk, out, streamed=True)
    assert out.texts == {0: "b", 1: "ac"} and out.finish == {0: "stop", 1: "length"} and out.completion_tokens == 3
    out = Outcome(COMPLETIONS, "random", False)
    read_choices(COMPLETIONS, {"choices": [{"index": 0, "text": "xy", "finish_reason": "length"}]}, out, False)
    assert out.texts == {0: "xy"} and out.finish == {0: "length"}
    out = Outcome(GENERATE, "random", True, choices=2)  # cumulative text; a batch carries "index"
    for event in ({"index": 1, "text": "h", "meta_info": {"finish_reason": None}},
                  {"index": 1, "text": "hi", "meta_info": {"finish_reason": {"type": "stop"}, "completion_tokens": 2}},
                  {"index": 0, "text": "yo", "meta_info": {"finish_reason": {"type": "length"}, "completion_tokens": 1}}):
        read_choices(GENERATE, event, out, streamed=True)
    assert out.texts == {0: "yo", 1: "hi"} and out.finish == {0: "length", 1: "stop"} and out.completion_tokens == 3


def test_proc_parsing():
    assert parse_stat("42 (a) b (c)) S 7 42 42 0 -1") == ("S", 7, 42)
    status = "Name:\tpython\nVmPeak:\t 9 kB\nVmRSS:\t  123456 kB\nRssShmem:\t 1024 kB\n"
    assert parse_status_kb(status, "VmRSS") == 123456 and parse_status_kb(status, "RssShmem") == 1024
    assert parse_status_kb("Name:\tzombie\n", "VmRSS") is None
    assert descendants(1, {1: 0, 5: 1, 3: 1, 9: 5, 4: 2}) == [1, 3, 5, 9]


def test_parse_gauges_keeps_unlabelled_samples():
    text = ("# HELP specserve:num_running_reqs x\n# TYPE specserve:num_running_reqs gauge\n"
            "specserve:num_running_reqs 2.0\nspecserve:token_usage 0.125\n"
            'specserve:replica_token_usage{dp_rank="0"} 0.5\nspecserve:gen_throughput NaN\n')
    gauges = parse_gauges(text)
    assert gauges["specserve:num_running_reqs"] == 2.0 and gauges["specserve:token_usage"] == 0.125
    assert not any("replica" in k for k in gauges)


def _ok(kind: str = "random", **kw) -> Outcome:
    base = {"status": 200, "texts": {0: "t"}, "finish": {0: "stop"}}
    return Outcome(GENERATE, kind, False, **{**base, **kw})


def test_no_5xx_counts_statuses_and_in_band_errors():
    assert checks.no_5xx([_ok(), _ok(status=409, kind="second")]).ok
    assert not checks.no_5xx([_ok(status=500)]).ok
    in_band = _ok(error={"message": "boom", "code": 500})  # an SSE error event after a 200
    assert not checks.no_5xx([in_band]).ok


@pytest.mark.parametrize("outcome, ok", [
    (_ok(), True),
    (_ok(closed_early=True, finish={}), True),  # hung up on purpose: no finish expected
    (_ok(finish={0: "abort"}), False),  # an abort the client did not cause
    (_ok(choices=2), False),  # n=2 but one choice never finished
    (_ok(transport_error="RemoteProtocolError"), False),
    (_ok(status=400, error={"message": "bad"}), False),
    (_ok(kind="second", status=409, error={"type": "conflict_error", "param": "rid"}), True),
])
def test_answered(outcome, ok):
    assert checks.answered([outcome]).ok is ok


def test_conflicts():
    conflict = {"type": "conflict_error", "param": "rid"}
    refused = _ok(kind="second", status=409, error=conflict)
    assert checks.conflicts([_ok(kind="first"), refused, _ok(kind="second")]).ok
    assert checks.conflicts([]).ok
    assert not checks.conflicts([_ok(status=409, error=conflict)]).ok  # a 409 for a request with its own rid
    assert not checks.conflicts([_ok(kind="second", status=409, error={"type": "invalid_request_error"})]).ok
    assert not checks.conflicts([_ok(kind="second"), _ok(kind="second")]).ok  # never refused at all


def test_greedy_unchanged():
    refs = {(GENERATE, 0): "same", (GENERATE, 1): "other"}
    good = _ok(kind="greedy", reference=0, texts={0: "same"})
    assert checks.greedy_unchanged([good, _ok()], refs).ok
    assert not checks.greedy_unchanged([good, _ok(kind="first", reference=1, texts={0: "same"})], refs).ok
    assert not checks.greedy_unchanged([_ok()], refs).ok, "nothing compared is not a pass"
    hung_up = _ok(kind="greedy", reference=0, texts={0: "sa"}, closed_early=True)
    assert checks.greedy_unchanged([good, hung_up], refs).ok


def test_idle_and_memory_and_exit():
    names = ("r", "q", "u")
    assert checks.is_idle({"r": 0, "q": 0, "u": 0.01}, names, 0.01)
    assert not checks.is_idle({"r": 1, "q": 0, "u": 0.01}, names, 0.01)
    assert not checks.is_idle({"r": 0, "q": 0, "u": 0.02}, names, 0.01)
    assert not checks.is_idle({}, names, 0.0)
    after1 = {"http 1": Memory(300.0, 0.0), "engine 2": Memory(1000.0, 100.0)}
    assert checks.bounded_memory(after1, {"http 1": Memory(310.0, 0.0), "engine 2": Memory(1060.0, 100.0)}, 64).ok
    assert not checks.bounded_memory(after1, {"http 1": Memory(310.0, 0.0), "engine 2": Memory(1070.0, 100)}, 64).ok
    # the KV pool's first-touched pages (shared) are not growth
    assert checks.bounded_memory(after1, {"http 1": Memory(300.0, 0.0), "engine 2": Memory(1500.0, 560.0)}, 64).ok
    assert not checks.bounded_memory(after1, {"http 1": Memory(300.0, 0.0)}, 64).ok  # the engine is gone
    assert not checks.bounded_memory({}, {}, 64).ok
    assert checks.clean_exit(0, [], "INFO fine").ok
    assert not checks.clean_exit(0, [], "Traceback (most recent call last)").ok
    assert not checks.clean_exit(None, [12], "").ok
