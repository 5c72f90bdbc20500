"""Overlapped plain decoding (engine/overlap.py) on the real SmolLM2: the step launched
before the previous one is read back gives exactly the outputs of the plain loop, for
every finish condition, seeded sampling, logprobs, arrivals, aborts and retraction, and
gives back the position it took for a request that had already ended.

The engine runs on the CPU here, where overlap is off by default (nothing to overlap);
the tests switch it on: the bookkeeping is the same on a GPU."""
from __future__ import annotations

import pytest

from specserve import Engine
from specserve.core.messages import GenerateReq
from specserve.core.sampling_params import SamplingParams
from tests.unit.model_utils import EXACT_ON_GPU

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain photosynthesis in one sentence.", "Count from one to five.",
           "Give me a recipe for pancakes.", "Who wrote Hamlet?"]
MIXED = [  # one per prompt: every way a request can end, sampled and greedy
    {"temperature": 0, "max_new_tokens": 40},  # ends on EOS
    {"temperature": 0, "max_new_tokens": 64, "stop": ["\n"]},
    {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 30, "seed": 7},
    {"temperature": 0, "max_new_tokens": 1},
    {"temperature": 0, "max_new_tokens": 33, "ignore_eos": True, "logprobs": True, "top_logprobs": 2},
    {"temperature": 1.0, "max_new_tokens": 25, "seed": 3, "stop_token_ids": [13]},
]


def _chat(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def _strip(res: dict) -> dict:
    """What a client sees. Logprobs to 1e-4: the batch changes shape as requests end one
    step apart, and a matmul's rounding follows its shape (the tokens must not change)."""
    lps = res.get("output_token_logprobs", [])
    return {"text": res["text"], "output_ids": res["output_ids"], "logprob_ids": [t for _, t in lps],
            "logprobs": [lp for lp, _ in lps],
            "finish_reason": res["meta_info"]["finish_reason"]}


def _assert_same(got: list[dict], expected: list[dict]) -> None:
    for g, e in zip(got, expected, strict=True):
        assert {**g, "logprobs": None} == {**e, "logprobs": None}
        assert g["logprobs"] == pytest.approx(e["logprobs"], abs=1e-4)


def _generate(engine: Engine, overlap: bool, ids, params) -> list[dict]:
    engine.scheduler.overlap = overlap
    try:
        return [_strip(r) for r in engine.generate(input_ids=ids, sampling_params=params)]
    finally:
        engine.scheduler.overlap = False


def _run_steps(sched, overlap: bool, schedule: dict[int, list[GenerateReq]], abort: dict[int, str]) -> dict:
    """Step the scheduler by hand, adding requests and aborting at given steps; return
    each request's token ids and finish reason, and whether a step was ever in flight."""
    sched.overlap, got, step, overlapped = overlap, {}, 0, False
    try:
        while step <= max(schedule) or sched.has_work:
            outs = []
            for g in schedule.get(step, []):
                outs += sched.add_request(g)
            if step in abort:
                outs += sched.abort(abort[step])
            outs += sched.step()
            overlapped |= sched._inflight is not None
            for out in outs:
                ids, _ = got.get(out.rid, ([], None))
                got[out.rid] = (ids + out.token_ids, out.finish_reason)
            step += 1
    finally:
        sched.overlap = False
    return {"results": got, "overlapped": overlapped}


def test_mixed_batch_matches_the_plain_loop(engine_no_leak):
    ids = [_chat(engine_no_leak, p) for p in PROMPTS]
    plain = _generate(engine_no_leak, False, ids, MIXED)
    engine_no_leak.scheduler.kv.flush_cache()
    overlapped = _generate(engine_no_leak, True, ids, MIXED)
    _assert_same(overlapped, plain)
    reasons = [r["finish_reason"]["type"] for r in plain]
    assert reasons.count("stop") >= 2 and reasons.count("length") >= 2  # both kinds of ending met
    engine_no_leak.scheduler.kv.flush_cache()
    engine_no_leak.scheduler.kv.assert_no_leak()


def test_penalties_fall_back_to_the_plain_loop(engine_no_leak):
    ids = [_chat(engine_no_leak, p) for p in PROMPTS[:3]]
    params = [{"temperature": 0, "max_new_tokens": 20, "frequency_penalty": 0.5}, MIXED[0], MIXED[2]]
    _assert_same(_generate(engine_no_leak, True, ids, params), _generate(engine_no_leak, False, ids, params))


def test_arrivals_and_aborts_mid_flight(engine_no_leak):
    sched = engine_no_leak.scheduler
    greedy = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)

    def schedule(tag: str) -> dict[int, list[GenerateReq]]:
        return {0: [GenerateReq(f"{tag}a", _chat(engine_no_leak, PROMPTS[0]), greedy),
                    GenerateReq(f"{tag}b", _chat(engine_no_leak, PROMPTS[1]), greedy)],
                4: [GenerateReq(f"{tag}c", _chat(engine_no_leak, PROMPTS[2]), greedy)],
                9: [GenerateReq(f"{tag}d", _chat(engine_no_leak, PROMPTS[3]), greedy)]}

    plain = _run_steps(sched, False, schedule("p"), {7: "pb"})
    sched.kv.flush_cache()
    over = _run_steps(sched, True, schedule("o"), {7: "ob"})
    assert over["overlapped"] and not plain["overlapped"]
    for name in "acd":
        assert over["results"][f"o{name}"] == plain["results"][f"p{name}"]
        assert len(over["results"][f"o{name}"][0]) == 30
    ob, pb = over["results"]["ob"], plain["results"]["pb"]
    assert ob[1]["type"] == pb[1]["type"] == "abort" and ob[0] == pb[0][:len(ob[0])]
    assert sched._inflight is None
    sched.kv.flush_cache()
    sched.kv.assert_no_leak()


def test_retraction_under_memory_pressure_matches(engine_no_leak, smollm2_dir):
    ids = [_chat(engine_no_leak, p) for p in PROMPTS]
    params = {"temperature": 0, "max_new_tokens": 40}
    expected = _generate(engine_no_leak, False, ids, params)
    small = Engine(str(smollm2_dir), log_level="warning", **(EXACT_ON_GPU | {"max_total_tokens": 240}))
    _assert_same(_generate(small, True, ids, params), expected)
    assert small.scheduler.stats.retractions_total > 0
    small.scheduler.kv.flush_cache()
    small.scheduler.kv.assert_no_leak()
