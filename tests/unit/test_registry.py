"""The speculative registry: one entry per algorithm, and a proposer added from outside.

A toy algorithm registered from the tests (toy_proposer.py: the last token repeated) runs
greedy-lossless through the offline engine here and through the real server
(tests/e2e/test_plugin_proposer.py). NGRAM keeps no state for a request once it leaves,
and a request that is retracted and resumes drafts again. Nothing outside spec/ compares
algorithm names.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specserve.args import ConfigError, parse_config
from specserve.spec import registry
from tests.unit import perfect_draft as pd
from tests.unit import toy_proposer
from tests.unit.model_utils import tiny_engine

GREEDY = {"temperature": 0, "max_new_tokens": 24}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 12, 12, 12, 12], [40, 41]]
PACKAGE = Path(__file__).resolve().parents[2] / "specserve"


def test_builtin_entries():
    assert set(registry.names()) >= {"EAGLE", "NEXTN", "EAGLE3", "NGRAM", "STANDALONE"}
    assert registry.canonical("nextn") == "EAGLE"
    with pytest.raises(ValueError, match="registered already"):
        registry.register(registry.Algorithm(name="EAGLE", make_proposer=toy_proposer.make_proposer))


def test_the_toy_is_a_flag_value_with_its_own_defaults():
    spec = parse_config(["--speculative-algorithm", "repeat"]).spec
    assert (spec.algorithm, spec.num_draft_tokens, spec.eagle_topk) == ("REPEAT", 4, 1)
    with pytest.raises(ConfigError, match=r"invalid choice: .NOPE. \(choose from .*REPEAT"):
        parse_config(["--speculative-algorithm", "NOPE"])


def test_the_toy_is_greedy_lossless_offline(tmp_path, smollm2_dir):
    target = pd.make_target(tmp_path / "target")
    want = [o["output_ids"] for o in tiny_engine(target, smollm2_dir).generate(input_ids=PROMPTS,
                                                                              sampling_params=GREEDY)]
    engine = tiny_engine(target, smollm2_dir, speculative_algorithm="REPEAT")
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == want
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)
    proposer = engine.scheduler.spec.proposer
    assert isinstance(proposer, toy_proposer.RepeatLast) and proposer.live == set()
    engine.scheduler.kv.flush_cache()
    engine.scheduler.kv.assert_no_leak()


def test_ngram_forgets_finished_requests_and_resumes_retracted_ones(tmp_path, smollm2_dir):
    """A KV budget that forces retraction: every request still finishes exactly as with
    plain decoding, and once all have finished the proposer holds no request state."""
    target = pd.make_target(tmp_path / "target")
    prompts = [[t + i for t in range(3, 40)] for i in range(6)]
    params = {"temperature": 0, "max_new_tokens": 40}
    want = [o["output_ids"] for o in tiny_engine(target, smollm2_dir).generate(input_ids=prompts,
                                                                              sampling_params=params)]
    engine = tiny_engine(target, smollm2_dir, speculative_algorithm="NGRAM", max_total_tokens=320,
                         chunked_prefill_size=64)
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == want
    assert engine.scheduler.stats.retractions_total > 0
    adapter = engine.scheduler.spec.proposer
    assert adapter._indexed == {} and adapter.ngram._reqs == {}
    engine.scheduler.kv.flush_cache()
    engine.scheduler.kv.assert_no_leak()


ALGORITHM_NAMES = {"EAGLE", "EAGLE3", "NEXTN", "NGRAM", "STANDALONE"}
# Tools built for EAGLE heads name them as the head formats they train and compare.
NAMED_ON_PURPOSE = {"train", "bench"}


def _compared_names(path: Path) -> list[str]:
    """Algorithm names appearing as string constants inside comparisons (==, !=, in)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Constant) and sub.value in ALGORITHM_NAMES:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {sub.value}")
    return found


def test_nothing_outside_spec_compares_algorithm_names():
    found = []
    for path in PACKAGE.rglob("*.py"):
        top = path.relative_to(PACKAGE).parts[0]
        if top not in ("spec", *NAMED_ON_PURPOSE):
            found += _compared_names(path)
    assert not found, "\n".join(found)


def test_parsing_a_command_line_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; from specserve.args import parse_config; "
            "parse_config(['--speculative-algorithm', 'EAGLE3']); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent)
    assert out.stdout.strip().endswith("False"), out.stderr[-2000:]
