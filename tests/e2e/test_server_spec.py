"""The real server with NGRAM speculation on: same greedy tokens as the plain engine,
speculative metrics exposed (per request, server info, Prometheus), bad input still 4xx."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.server_utils import launched_server

pytestmark = pytest.mark.slow

PROMPTS = ["Copy this list: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry.",
           "List 3 countries and their capitals."]


@pytest.fixture(scope="module")
def spec_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("spec_server") / "server.log"
    # the governor stays off: every request must draft (its meta is under test), whatever
    # the timings on a loaded CPU make of NGRAM against plain decoding
    with launched_server(["--speculative-algorithm", "NGRAM", "--speculative-adaptive", "off"], log) as url:
        yield url


def test_greedy_tokens_equal_the_plain_engine_and_meta_info(spec_url, smollm2_engine):
    for text in PROMPTS:
        ids = smollm2_engine.tokenizer.encode_chat([{"role": "user", "content": text}])
        params = {"temperature": 0, "max_new_tokens": 48}
        plain = smollm2_engine.generate(input_ids=ids, sampling_params=params)
        smollm2_engine.scheduler.kv.flush_cache()
        served = httpx.post(f"{spec_url}/generate", json={"input_ids": ids, "sampling_params": params},
                            timeout=300).json()
        assert served["output_ids"] == plain["output_ids"]
        meta = served["meta_info"]
        assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] >= 1.0
        assert 0.0 <= meta["spec_accept_rate"] <= 1.0


def test_openai_streaming_and_spec_metrics(spec_url):
    client = openai.OpenAI(base_url=f"{spec_url}/v1", api_key="EMPTY", timeout=300, max_retries=0)
    stream = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": PROMPTS[0]}],
                                            temperature=0, max_tokens=40, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.strip()
    info = httpx.get(f"{spec_url}/get_server_info", timeout=30).json()
    assert info["internal_states"][0]["avg_spec_accept_length"] > 1.0
    assert info["spec"]["algorithm"] == "NGRAM"
    metrics = httpx.get(f"{spec_url}/metrics", timeout=30).text
    assert "sglang:spec_accept_length" in metrics and "specserve:spec_accept_rate" in metrics
    bad = httpx.post(f"{spec_url}/v1/chat/completions", json={"messages": [], "max_tokens": 5}, timeout=30)
    assert bad.status_code == 400
