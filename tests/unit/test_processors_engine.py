"""Logits processors with speculation on, through the real engine on SmolLM2.

Penalties, logit_bias and grammars (JSON schema, regex, EBNF) keep their drafts, and the
output equals plain decoding's with the same processors: greedy token for token, seeded
sampling token for token (Gumbel verification draws plain sampling's noise), logprobs to
fp32 rounding. One batch of eight requests mixes every processor, greedy and sampled;
batch 1 repeats two of them. NGRAM, STANDALONE (the target as its own draft: long
accepted runs cross grammar states) and EAGLE3 (the shipped head) each run it.
"""
from __future__ import annotations

import json

import pytest

from specserve import Engine
from tests.unit.model_utils import EXACT_ON_GPU

pytestmark = pytest.mark.slow

PROMPTS = [
    "Copy this list: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry.",
    "Repeat this sentence exactly three times: the quick brown fox jumps over the lazy dog.",
    "Give me a person as JSON with a name and an age.",
    "Is the sky blue? Answer yes or no, then say why.",
    "Count from one to twenty, separated by commas.",
    "Describe a city as JSON with its name and population.",
    "Write the alphabet in capital letters, separated by spaces.",
    "Answer with a colour name.",
]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "population": {"type": "integer"}},
        "required": ["name", "population"]}
REGEX = r"(yes|no), because [a-z ,]{4,40}\."
EBNF = 'root ::= colour "."\ncolour ::= "red" | "green" | "blue" | "yellow"'
N = 32
MIXED = [
    {"temperature": 0, "frequency_penalty": 0.8, "presence_penalty": 0.4, "logprobs": True, "top_logprobs": 3},
    {"temperature": 0, "repetition_penalty": 1.3, "logit_bias": {"29": 4.0, "30": -100}},
    {"temperature": 0, "json_schema": json.dumps(PERSON), "logprobs": True},
    {"temperature": 0, "regex": REGEX},
    {"temperature": 0.8, "seed": 11, "frequency_penalty": 0.5, "logit_bias": {"28": 3.0}},
    {"temperature": 0.8, "seed": 12, "json_schema": json.dumps(CITY)},
    {"temperature": 0.7, "seed": 13, "top_p": 0.9, "repetition_penalty": 1.2},
    {"temperature": 0, "ebnf": EBNF},
]
ALGORITHMS = {
    "NGRAM": {"speculative_algorithm": "NGRAM"},
    "STANDALONE": {"speculative_algorithm": "STANDALONE", "speculative_num_steps": 3,
                   "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6},
    "EAGLE3": {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
               "speculative_num_draft_tokens": 4},
}


def _params() -> list[dict]:
    return [{**p, "max_new_tokens": N} for p in MIXED]


def _ids(engine: Engine) -> list[list[int]]:
    return [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]


def _clean(engine: Engine) -> None:
    assert not engine.scheduler.has_work
    engine.scheduler.kv.flush_cache()
    engine.scheduler.kv.assert_no_leak()


@pytest.fixture(scope="module")
def reference(smollm2_engine) -> list[dict]:
    outs = smollm2_engine.generate(input_ids=_ids(smollm2_engine), sampling_params=_params())
    _clean(smollm2_engine)
    return outs


def test_plain_outputs_obey_their_grammars(reference):
    jsonschema = pytest.importorskip("jsonschema")
    person, city = json.loads(reference[2]["text"]), reference[5]["text"]
    jsonschema.validate(person, PERSON)
    if reference[5]["meta_info"]["finish_reason"]["type"] == "stop":
        jsonschema.validate(json.loads(city), CITY)
    assert reference[3]["text"].startswith(("yes, because", "no, because"))
    assert reference[7]["text"] in ("red.", "green.", "blue.", "yellow.")


@pytest.mark.parametrize("algo", list(ALGORITHMS))
def test_speculation_under_processors_equals_plain_decoding(algo, reference, smollm2_dir):
    target = "smollm2-135m" if algo == "EAGLE3" else str(smollm2_dir)  # the catalogue name finds the shipped head
    draft = {"speculative_draft_model_path": str(smollm2_dir)} if algo == "STANDALONE" else {}
    engine = Engine(target, log_level="warning", speculative_adaptive="off", **EXACT_ON_GPU, **ALGORITHMS[algo],
                    **draft)
    outs = engine.generate(input_ids=_ids(engine), sampling_params=_params())
    for i, (got, want) in enumerate(zip(outs, reference)):
        assert got["output_ids"] == want["output_ids"], (i, MIXED[i], got["text"], want["text"])
    for i in (0, 2):  # logprobs from the processed verify logits equal plain decoding's
        got_lp = [lp for lp, _ in outs[i]["output_token_logprobs"]]
        want_lp = [lp for lp, _ in reference[i]["output_token_logprobs"]]
        assert got_lp == pytest.approx(want_lp, abs=2e-4)
    verifies = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    accepted = sum(o["meta_info"]["completion_tokens"] for o in outs)
    assert verifies > 0 and accepted / verifies > 1.2, (verifies, accepted)  # the drafts were kept
    one = engine.generate(input_ids=_ids(engine)[2], sampling_params=_params()[2])
    assert one["output_ids"] == reference[2]["output_ids"]
    _clean(engine)
