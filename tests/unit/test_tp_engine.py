"""Tensor parallelism end to end on the CPU (gloo): the offline Engine with tp_size=2 runs
two engine processes (engine/ranks.py) and must give what one process gives.

Every algorithm (plain, NGRAM, STANDALONE, EAGLE-2, EAGLE-3, MTP) on targets whose drafts
are perfect (perfect_draft.py), greedy: the same tokens and the same acceptance counts at
TP 2 as at TP 1, so the drafts run and are accepted under TP, not merely verified. SmolLM2
with its shipped EAGLE-3 head: greedy token-identical on real prompts, and seeded sampling
the same draw for draw, also under a JSON schema, penalties and logit_bias (every rank
builds the grammar in the same step). After each engine's requests its KV memory is back
to idle.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit import perfect_draft as pd
from tests.unit.model_utils import tiny_engine

pytestmark = pytest.mark.slow

_TREE = {"speculative_num_steps": 2, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 4,
         "speculative_adaptive": "off"}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44, 45]]
GREEDY = {"temperature": 0, "max_new_tokens": 12}
_STATS = ("spec_verify_ct", "spec_accept_token_num")


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-engine")
    target = pd.make_target(root / "target")
    target3 = pd.make_target(root / "target3", eagle3=True)
    return {"target": target, "target3": target3, "mtp": pd.perfect_mtp_deepseek(pd.make_target(root / "mtp")),
            "eagle2": pd.perfect_eagle2(root / "eagle2", target), "eagle3": pd.perfect_eagle3(root / "eagle3", target3)}


JOBS = {  # name -> (target, flags)
    "plain": ("target", {}),
    "NGRAM": ("target", {"speculative_algorithm": "NGRAM", "speculative_adaptive": "off"}),
    "STANDALONE": ("target", {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "target", **_TREE}),
    "EAGLE": ("target", {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "eagle2", **_TREE}),
    "EAGLE3": ("target3", {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "eagle3", **_TREE}),
    "MTP": ("mtp", {"speculative_algorithm": "EAGLE", **_TREE}),
}


def _generate(engine, prompts, params) -> list[dict]:
    out = engine.generate(input_ids=prompts, sampling_params=params)
    assert engine.kv_leak() is None
    return out


@pytest.mark.parametrize("job", list(JOBS))
def test_tp2_equals_tp1_for_every_algorithm(targets, smollm2_dir, job):
    target, flags = JOBS[job]
    flags = {k: str(targets[v]) if k == "speculative_draft_model_path" else v for k, v in flags.items()}
    one = _generate(tiny_engine(targets[target], smollm2_dir, **flags), PROMPTS, GREEDY)
    with tiny_engine(targets[target], smollm2_dir, tp_size=2, **flags) as engine:
        two = _generate(engine, PROMPTS, GREEDY)
    assert [o["output_ids"] for o in two] == [o["output_ids"] for o in one]
    for a, b in zip(one, two):
        assert {k: b["meta_info"].get(k) for k in _STATS} == {k: a["meta_info"].get(k) for k in _STATS}
    if job not in ("plain", "NGRAM"):  # perfect drafts: most of each verify is accepted
        accepted = sum(o["meta_info"]["spec_accept_token_num"] for o in two)
        assert accepted > sum(o["meta_info"]["spec_verify_ct"] for o in two)


def test_the_governor_decides_on_rank_0_for_every_rank(targets, smollm2_dir):
    """With the governor on, rank 0's timed choices are broadcast (spec/governor.py
    RankZeroGovernor): the ranks run the same steps, so the output is plain decoding's."""
    flags = {"speculative_algorithm": "NGRAM", "speculative_adaptive": "on"}
    want = _generate(tiny_engine(targets["target"], smollm2_dir), PROMPTS, GREEDY)
    with tiny_engine(targets["target"], smollm2_dir, tp_size=2, **flags) as engine:
        got = _generate(engine, PROMPTS, GREEDY)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]


def test_smollm2_eagle3_at_tp2(smollm2_dir):
    from specserve import Engine

    flags = {"speculative_algorithm": "EAGLE3", "log_level": "warning"}
    chats = ["What is the capital of France?", "Count from one to ten."]
    one = Engine(**flags)
    prompts = [one.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in chats]
    sampled = [{"temperature": 0.8, "top_p": 0.9, "seed": 7 + i, "max_new_tokens": 12} for i in range(2)]
    want = _generate(one, prompts, {"temperature": 0, "max_new_tokens": 20})
    want_sampled = _generate(one, prompts, sampled)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
    processed = [{"temperature": 0, "max_new_tokens": 16, "json_schema": json.dumps(schema)},
                 {"temperature": 0.8, "seed": 3, "max_new_tokens": 12, "frequency_penalty": 0.5, "logit_bias": {"28": 2}}]
    want_processed = _generate(one, prompts, processed)
    with Engine(tp_size=2, **flags) as two:
        got = _generate(two, prompts, {"temperature": 0, "max_new_tokens": 20})
        got_sampled = _generate(two, prompts, sampled)
        got_processed = _generate(two, prompts, processed)
        # unseeded: each request's seed comes from the scheduler's generator, one for all ranks
        unseeded = _generate(two, prompts, {"temperature": 1.0, "max_new_tokens": 12})
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert [o["output_ids"] for o in got_sampled] == [o["output_ids"] for o in want_sampled]
    assert [o["output_ids"] for o in got_processed] == [o["output_ids"] for o in want_processed]
    assert all(len(o["output_ids"]) > 0 for o in unseeded)
