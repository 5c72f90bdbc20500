"""Schemathesis over the whole HTTP surface: every operation of `/openapi.json`, generated
requests (valid and invalid bodies, unexpected methods) sent to the ASGI app over the fake
engine of test_http.py, and every answer checked against the document: no 5xx, a documented
status, a documented content type, a body (or each SSE event) that matches its schema, a 405
with an `Allow` header, schema-invalid input refused with a 4xx. Then the same behind an API
key (AUTH_EXAMPLES each): requests without it or with a wrong one must be 401s.

Bounded for CI: MAX_EXAMPLES generated cases per operation on top of schemathesis' coverage
cases (boundary values, each field of a wrong type, each undeclared method), a fixed seed,
derandomized, no example database: every run sends the same requests. For a longer hunt set
SPECSERVE_FUZZ_EXAMPLES (e.g. 300) and SPECSERVE_FUZZ_SEED. Not checked: that a schema-valid
request is accepted, since the schema cannot state the limits that depend on the model
(context length, vocabulary) or on SamplingParams.validate's ranges, which answer 400.
"""
from __future__ import annotations

import functools
import os

import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig
from tokenizers import Tokenizer, decoders, models

from specserve.server.http import build_app
from tests.unit.test_http import VOCAB, FakeEngineClient, FakeTokenizer

MAX_EXAMPLES = int(os.environ.get("SPECSERVE_FUZZ_EXAMPLES", "30"))
AUTH_EXAMPLES = 5  # the same routes again, behind the key


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which a ByteLevel tokenizer's vocabulary uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


@functools.cache
def fake_tokenizer_json() -> str:
    """A tokenizer.json in which token i is chr(i)'s UTF-8 bytes, as FakeTokenizer decodes it,
    so that the grammar compiler (llguidance) can check constrained requests."""
    alphabet = _byte_alphabet()
    vocab = {"".join(alphabet[b] for b in chr(i).encode()): i for i in range(VOCAB)}
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()  # type: ignore[assignment]
    return tok.to_str()


class GrammarTokenizer(FakeTokenizer):
    def to_json(self) -> str:
        return fake_tokenizer_json()


def fuzz_engine(api_key: str | None = None) -> FakeEngineClient:
    engine = FakeEngineClient(api_key=api_key)
    engine.tokenizer = GrammarTokenizer()
    return engine


def fuzz_config(max_examples: int, **extra: object) -> SchemathesisConfig:
    return SchemathesisConfig.from_dict({
        "seed": int(os.environ.get("SPECSERVE_FUZZ_SEED", "52")),
        "generation": {"max-examples": max_examples, "deterministic": True, "database": "none"},
        # Schema-valid requests may still exceed the model's limits: a 400, not a failure.
        "checks": {"positive_data_acceptance": {"enabled": False}},
        **extra,
    })


schema = schemathesis.openapi.from_asgi("/openapi.json", build_app(fuzz_engine()), config=fuzz_config(MAX_EXAMPLES))
KEY = "fuzz-key"
# With --api-key: the document declares the Bearer scheme, schemathesis sends the key, and its
# ignored_auth check sends requests without it or with a wrong one, which must be 401s.
auth_schema = schemathesis.openapi.from_asgi(
    "/openapi.json", build_app(fuzz_engine(api_key=KEY)), headers={"Authorization": f"Bearer {KEY}"},
    config=fuzz_config(AUTH_EXAMPLES, auth={"openapi": {"bearer": {"bearer": KEY}}}))
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@schema.parametrize()
@SETTINGS
def test_every_operation_answers_as_documented(case: schemathesis.Case) -> None:
    case.call_and_validate()


@auth_schema.parametrize()
@SETTINGS
def test_with_an_api_key_too(case: schemathesis.Case) -> None:
    case.call_and_validate()


def test_the_fake_engine_compiles_grammars() -> None:
    """Constrained requests get past the grammar check here (the fuzzer's come through it)."""
    http = TestClient(build_app(fuzz_engine()))
    for body in ({"prompt": "a", "max_tokens": 2, "guided_regex": "[ab]+"},
                 {"prompt": "a", "max_tokens": 2, "response_format": {"type": "json_object"}}):
        assert http.post("/v1/completions", json=body).status_code == 200
    r = http.post("/v1/completions", json={"prompt": "a", "guided_regex": "(", "max_tokens": 2})
    assert r.status_code == 400 and "invalid regex" in r.json()["error"]["message"]
