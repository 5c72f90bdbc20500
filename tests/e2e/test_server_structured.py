"""Structured outputs through the real server with speculation on, per algorithm.

With NGRAM, STANDALONE and EAGLE3: sampled (T=0.8) `json_schema` requests from the
official `openai` client (fifty with EAGLE3, sixteen with the others) all parse and
validate against their schema; greedy output under
a grammar equals the plain engine's under the same grammar (json_schema on the OpenAI
route, regex and EBNF on /generate); a bad schema or a regex no text matches is a 400
naming the problem, and the server goes on serving.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.server_utils import launched_server

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
ASK = [{"role": "user", "content": "Describe a person as JSON: name, age and pets."}]
REGEX = r"(yes|no), because [a-z ,]{4,40}\."
EBNF = 'root ::= colour "."\ncolour ::= "red" | "green" | "blue" | "yellow"'
ALGORITHMS = {
    "NGRAM": ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6"],
    "STANDALONE": ["--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "2",
                   "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3"],
    "EAGLE3": ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
               "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"],
}


ANSWERS = {"NGRAM": 16, "STANDALONE": 16, "EAGLE3": 50}


@pytest.fixture(scope="module", params=list(ALGORITHMS))
def served(request, tmp_path_factory, smollm2_dir) -> Iterator[tuple[str, str]]:
    """(algorithm, url) of a server speculating with it."""
    args = ALGORITHMS[request.param] + ["--speculative-adaptive", "off"]
    if request.param == "STANDALONE":
        args += ["--speculative-draft-model-path", str(smollm2_dir)]
    log = tmp_path_factory.mktemp(f"structured_{request.param}") / "server.log"
    with launched_server(args, log) as url:
        yield request.param, url


@pytest.fixture
def url(served) -> str:
    return served[1]


def test_sampled_schema_answers_all_validate(served):
    algo, url = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", timeout=600, max_retries=0)

    def ask(seed: int) -> str:
        r = client.chat.completions.create(model="smollm2-135m", messages=ASK, response_format=FORMAT,
                                           temperature=0.8, seed=seed, max_tokens=96)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        return r.choices[0].message.content or ""

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(ANSWERS[algo])))
    for text in answers:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(answers)) > 5  # sampled, not one answer every time


_PLAIN: dict[str, list[int]] = {}  # the plain engine's greedy ids per case, computed once for all servers


def test_greedy_under_a_grammar_equals_the_plain_engine(url, smollm2_engine):
    ids = smollm2_engine.tokenizer.encode_chat(ASK)
    cases = [({"json_schema": json.dumps(SCHEMA)}, ids),
             ({"regex": REGEX}, smollm2_engine.tokenizer.encode_chat(
                 [{"role": "user", "content": "Is the sky blue? Answer yes or no, then say why."}])),
             ({"ebnf": EBNF}, smollm2_engine.tokenizer.encode_chat([{"role": "user", "content": "Name a colour."}]))]
    for grammar, prompt in cases:
        params = {"temperature": 0, "max_new_tokens": 64, **grammar}
        key = json.dumps(grammar)
        if key not in _PLAIN:
            _PLAIN[key] = smollm2_engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]
            smollm2_engine.scheduler.kv.flush_cache()
        served = httpx.post(f"{url}/generate", json={"input_ids": prompt, "sampling_params": params},
                            timeout=300).json()
        assert served["output_ids"] == _PLAIN[key], grammar
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "response_format": FORMAT,
                                                           "temperature": 0, "max_tokens": 96}, timeout=300).json()
    jsonschema.validate(json.loads(chat["choices"][0]["message"]["content"]), SCHEMA)


@pytest.mark.parametrize("body, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "Invalid type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{not json"}}},
     "not valid JSON"),
    ({"guided_regex": "[^\\s\\S]"}, "matches no text"),
    ({"guided_regex": "(a"}, "unclosed group"),
])
def test_bad_grammars_are_a_400_and_the_server_goes_on(url, body, needle):
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    ok = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 2}, timeout=120)
    assert ok.status_code == 200
