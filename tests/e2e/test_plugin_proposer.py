"""End-to-end: a speculative algorithm registered outside specserve, served over HTTP.

The server process imports tests/unit/toy_proposer.py (REPEAT: the last token repeated)
before parsing its flags; its engine process finds the toy's proposer factory by module
name. Greedy answers through /generate equal the offline engine's plain decoding.
"""
from __future__ import annotations

import httpx
import pytest

from tests.e2e.server_utils import launched_server
from tests.unit import perfect_draft as pd
from tests.unit.model_utils import tiny_engine

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 12, 12, 12, 12]]
GREEDY = {"temperature": 0, "max_new_tokens": 16}


def test_a_registered_toy_proposer_is_lossless_through_the_server(tmp_path, smollm2_dir):
    target = pd.make_target(tmp_path / "target")
    want = [o["output_ids"] for o in tiny_engine(target, smollm2_dir).generate(input_ids=PROMPTS,
                                                                              sampling_params=GREEDY)]
    args = ["--model", str(target), "--tokenizer-path", str(smollm2_dir), "--speculative-algorithm", "REPEAT"]
    with launched_server(args, tmp_path / "server.log", preload="tests.unit.toy_proposer") as url:
        got = httpx.post(f"{url}/generate", json={"input_ids": PROMPTS, "sampling_params": GREEDY},
                         timeout=120).json()
        info = httpx.get(f"{url}/get_server_info", timeout=30).json()
    assert [g["output_ids"] for g in got] == want
    assert all(g["meta_info"]["spec_verify_ct"] > 0 for g in got)
    assert info["spec"]["algorithm"] == "REPEAT"
