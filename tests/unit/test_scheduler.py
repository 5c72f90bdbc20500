"""The scheduler on the real SmolLM2: batching, prefix cache, chunked prefill, retraction,
finish conditions, seeds and aborts. Every test ends with the KV allocator back at its
initial free count."""
from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.core.messages import GenerateReq
from specserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

QUESTION = "List 3 countries and their capitals."
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain photosynthesis in one sentence.", "Count from one to five.",
           "Give me a recipe for pancakes.", "Who wrote Hamlet?"]
GREEDY = {"temperature": 0, "max_new_tokens": 24}


def _chat(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def _assert_clean(engine: Engine) -> None:
    engine.scheduler.kv.flush_cache()
    engine.scheduler.kv.assert_no_leak()


def test_greedy_matches_transformers(engine_no_leak, smollm2_dir):
    transformers = pytest.importorskip("transformers")
    ids = _chat(engine_no_leak, QUESTION)
    ours = engine_no_leak.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 64})
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32)
    eos = sorted(engine_no_leak.tokenizer.eos_token_ids)
    ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64, eos_token_id=eos,
                      pad_token_id=eos[0])[0, len(ids):].tolist()
    assert ours["output_ids"] == ref
    assert len(ref) == 39 and ours["text"].startswith("1. Russia: Moscow")
    assert ours["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}


def test_batched_equals_one_by_one(engine_no_leak):
    ids = [_chat(engine_no_leak, p) for p in PROMPTS]
    batched = engine_no_leak.generate(input_ids=ids, sampling_params=GREEDY)
    _assert_clean(engine_no_leak)
    for one, res in zip(ids, batched):
        alone = engine_no_leak.generate(input_ids=one, sampling_params=GREEDY)
        assert alone["output_ids"] == res["output_ids"]
        _assert_clean(engine_no_leak)


def test_prefix_cache_hit_gives_identical_output(engine_no_leak):
    ids = _chat(engine_no_leak, QUESTION)
    first = engine_no_leak.generate(input_ids=ids, sampling_params=GREEDY)
    second = engine_no_leak.generate(input_ids=ids, sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == len(ids) - 1
    assert second["output_ids"] == first["output_ids"]
    # a different question sharing the system prompt and chat header hits part of it
    third = engine_no_leak.generate(input_ids=_chat(engine_no_leak, PROMPTS[0]), sampling_params=GREEDY)
    assert 0 < third["meta_info"]["cached_tokens"] < len(ids)


BATCH_PARAMS = {"temperature": 0, "max_new_tokens": 40}


@pytest.fixture(scope="module")
def batch_reference(smollm2_engine) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy outputs) of PROMPTS in one batch on the shared engine, computed once."""
    ids = [_chat(smollm2_engine, p) for p in PROMPTS]
    outs = smollm2_engine.generate(input_ids=ids, sampling_params=BATCH_PARAMS)
    smollm2_engine.scheduler.kv.flush_cache()
    return ids, [r["output_ids"] for r in outs]


@pytest.mark.parametrize("flags", [{"chunked_prefill_size": 7}, {"disable_radix_cache": True},
                                   {"max_total_tokens": 260}])
def test_chunked_prefill_no_cache_and_retraction_give_identical_output(batch_reference, smollm2_dir, flags):
    ids, expected = batch_reference
    params = BATCH_PARAMS
    other = Engine(str(smollm2_dir), log_level="warning", **flags)
    got = [r["output_ids"] for r in other.generate(input_ids=ids, sampling_params=params)]
    assert got == expected
    if "max_total_tokens" in flags:  # 6 requests of ~40+40 tokens cannot all fit in 260 slots
        assert other.scheduler.stats.retractions_total > 0
    _assert_clean(other)


def test_continuous_decode_steps_batch_admissions(engine_no_leak, smollm2_dir):
    """--num-continuous-decode-steps 4: a request that arrives while another decodes is
    admitted after that look's 4 decode steps, not at the next step; both answers are those
    of admitting at every step."""
    ids = [_chat(engine_no_leak, p) for p in PROMPTS[:2]]
    expected = [engine_no_leak.generate(input_ids=one, sampling_params=GREEDY)["output_ids"] for one in ids]
    other = Engine(str(smollm2_dir), log_level="warning", num_continuous_decode_steps=4)
    sched, got = other.scheduler, {"a": [], "b": []}

    def step() -> None:
        for out in sched.step():
            got[out.rid] += out.token_ids

    sched.add_request(GenerateReq("a", ids[0], SamplingParams(temperature=0, max_new_tokens=24)))
    step()  # a's prefill
    step()  # a's first decode step: a look found nothing waiting, three more decode steps are owed
    sched.add_request(GenerateReq("b", ids[1], SamplingParams(temperature=0, max_new_tokens=24)))
    for _ in range(3):
        step()
        assert len(sched.running) == 1 and len(sched.waiting) == 1
    step()  # the next look: b's prefill
    assert len(sched.running) == 2 and not sched.waiting
    while sched.has_work:
        step()
    assert [got["a"], got["b"]] == expected
    _assert_clean(other)


def test_stop_strings_stop_ids_and_max_tokens(engine_no_leak):
    ids = _chat(engine_no_leak, QUESTION)
    r = engine_no_leak.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 64,
                                                                "stop": [" Mosc"]})
    assert r["text"] == "1. Russia:" and r["meta_info"]["finish_reason"] == {"type": "stop", "matched": " Mosc"}
    r = engine_no_leak.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 64,
                                                                "stop_token_ids": [42]})
    assert r["output_ids"] == [33, 30, 6054, 42] and r["meta_info"]["finish_reason"]["matched"] == 42
    r = engine_no_leak.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 5})
    assert len(r["output_ids"]) == 5 and r["meta_info"]["finish_reason"] == {"type": "length"}
    r = engine_no_leak.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 50,
                                                                "ignore_eos": True})
    assert len(r["output_ids"]) == 50


def test_seeded_sampling_is_reproducible_and_batch_independent(engine_no_leak):
    ids = _chat(engine_no_leak, PROMPTS[1])
    params = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 20, "seed": 1234}
    a = engine_no_leak.generate(input_ids=ids, sampling_params=params)["output_ids"]
    both = engine_no_leak.generate(input_ids=[_chat(engine_no_leak, PROMPTS[2]), ids],
                                   sampling_params=params)
    assert both[1]["output_ids"] == a
    other = engine_no_leak.generate(input_ids=ids, sampling_params={**params, "seed": 99})["output_ids"]
    assert other != a


def test_abort_frees_memory_and_bad_requests_are_refused(engine_no_leak):
    sched = engine_no_leak.scheduler
    ids = _chat(engine_no_leak, QUESTION)
    assert not sched.add_request(GenerateReq("a1", ids, SamplingParams(temperature=0, max_new_tokens=100)))
    for _ in range(5):
        sched.step()
    outs = sched.abort("a1")
    assert outs[0].finished and outs[0].finish_reason["type"] == "abort"
    refused = sched.add_request(GenerateReq("a2", [1] * 10_000, SamplingParams()))
    assert refused[0].finish_reason["type"] == "abort" and "context length" in refused[0].finish_reason["message"]
    refused = sched.add_request(GenerateReq("a3", [10**6], SamplingParams()))
    assert "vocabulary" in refused[0].finish_reason["message"]
    assert not sched.has_work


def test_logprobs_match_log_softmax(engine_no_leak):
    ids = _chat(engine_no_leak, QUESTION)
    r = engine_no_leak.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 3,
                                                                "logprobs": True, "top_logprobs": 2})
    lps = r["output_token_logprobs"]
    assert [t for _, t in lps] == r["output_ids"] and all(lp <= 0 for lp, _ in lps)
