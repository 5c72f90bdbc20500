"""Start-up: what can be checked without weights is checked first.

A taken port, a bad draft path, token map or tokenizer path, a draft LLM with another
vocabulary, and an architecture we do not serve all fail in `preflight.py`, before any
weights load (the server exits with status 1 and one line). The speculative set-up
(shipped head, its default tree) is settled there too, so the engine is sized by it.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from specserve import preflight
from specserve.args import parse_config
from tests.unit import perfect_draft as pd
from tests.unit.model_utils import save_tiny_hf

ROOT = Path(__file__).resolve().parents[2]


def _launch(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specserve.launch_server", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return pd.make_target(tmp_path_factory.mktemp("startup") / "target")


@pytest.fixture(scope="module")
def eagle2(target) -> Path:
    return pd.perfect_eagle2(target.parent / "eagle2", target)


def test_a_taken_port_fails_first():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = _launch("--port", str(port), "--model", "/nonexistent/model")
    assert out.returncode == 1
    assert f"127.0.0.1:{port} is already in use" in out.stderr
    assert "nonexistent" not in out.stderr  # the model was never looked at


def test_a_bad_draft_path_fails_before_the_target_is_looked_at(monkeypatch):
    def no_target(*args, **kwargs):
        raise AssertionError("the target was resolved before the draft path was checked")

    monkeypatch.setattr(preflight, "resolve_model_dir", no_target)
    cfg = parse_config(["--model", "smollm2-135m", "--speculative-algorithm", "STANDALONE",
                        "--speculative-draft-model-path", "/nonexistent/draft"])
    with pytest.raises(ValueError, match="/nonexistent/draft"):
        preflight.resolve_sources(cfg)


def test_the_server_reports_a_bad_draft_path_before_loading_weights(target, smollm2_dir):
    from tests.e2e.server_utils import free_port

    out = _launch("--model", str(target), "--tokenizer-path", str(smollm2_dir), "--port", str(free_port()),
                  "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/nonexistent/head")
    assert out.returncode == 1
    assert "error: model path '/nonexistent/head' does not exist" in out.stderr
    assert "Loaded" not in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("flags,needle", [
    (["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "EAGLE2",
      "--speculative-token-map", "/nonexistent/map.pt"],
     "speculative token map /nonexistent/map.pt does not exist"),
    (["--tokenizer-path", "/nonexistent/tokenizer"], "model path '/nonexistent/tokenizer' does not exist"),
    (["--speculative-algorithm", "EAGLE"], "needs --speculative-draft-model-path: the target model has no MTP"),
])
def test_sources_are_checked_without_weights(target, eagle2, smollm2_dir, flags, needle):
    flags = [str(eagle2) if f == "EAGLE2" else f for f in flags]
    if "--tokenizer-path" not in flags:
        flags = [*flags, "--tokenizer-path", str(smollm2_dir)]
    cfg = parse_config(["--model", str(target), *flags])
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        preflight.resolve_sources(cfg)


def test_a_draft_llm_with_another_vocabulary_is_refused(target, smollm2_dir, tmp_path):
    draft = save_tiny_hf("llama", tmp_path / "draft", vocab_size=512)
    cfg = parse_config(["--model", str(target), "--tokenizer-path", str(smollm2_dir), "--speculative-algorithm",
                        "STANDALONE", "--speculative-draft-model-path", str(draft)])
    with pytest.raises(ValueError, match=r"vocabulary \(512\) differs from the target's \(49152\)"):
        preflight.resolve_sources(cfg)


def test_an_unserved_architecture_is_refused(target, smollm2_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((target / "config.json").read_text()) | {"architectures": ["GPT2LMHeadModel"]}
    (other / "config.json").write_text(json.dumps(config))
    cfg = parse_config(["--model", str(other), "--tokenizer-path", str(smollm2_dir)])
    with pytest.raises(ValueError, match="architecture GPT2LMHeadModel is not supported"):
        preflight.resolve_sources(cfg)


def test_the_shipped_head_and_its_tree_are_settled_at_start_up(smollm2_dir):
    """EAGLE3 on the default model with no tree flags: the shipped head's own tree (5,6,32)
    and batch tree (3,2,6) on a GPU, its CPU tree (one draft token) and no batch tree on the
    CPU, before the engine sizes anything by them."""
    from specserve.models.llama import LlamaConfig
    from specserve.models.loader import read_hf_config
    from specserve.spec import registry

    start, _ = preflight.resolve_sources(parse_config(["--speculative-algorithm", "EAGLE3", "--device", "cpu"]))
    spec = start.config.spec
    assert Path(spec.draft_dir).name == "smollm2-135m-eagle3" and start.model_dir == smollm2_dir
    assert (spec.num_steps, spec.eagle_topk, spec.num_draft_tokens, spec.batch_tree) == (1, 1, 2, "off")
    assert start.spec.needs.verify_tokens == 2
    target = LlamaConfig.from_hf(read_hf_config(smollm2_dir))  # a target on a GPU: what preflight plans there
    gpu = registry.plan(parse_config(["--speculative-algorithm", "EAGLE3"]).spec, smollm2_dir, target)
    assert gpu is not None and not gpu.spec.on_cpu
    assert (gpu.spec.num_steps, gpu.spec.eagle_topk, gpu.spec.num_draft_tokens) == (5, 6, 32)
    assert gpu.spec.batch_tree == "3,2,6" and gpu.needs.verify_tokens == 32


def test_the_table_is_wide_enough_for_the_shipped_heads_tree(smollm2_dir):
    """EAGLE3 on the default model (the shipped head's GPU tree of 32 nodes, asked for) driven to the end of a
    short context: every verify writes 32 table columns past kv_len, and the output equals
    plain decoding's, cut by the same context length."""
    from specserve.offline import Engine

    prompt = list(range(1000, 1060))
    params = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}
    flags = {"context_length": 96, "log_level": "warning"}
    want = Engine(**flags).generate(input_ids=prompt, sampling_params=params)
    spec = Engine(speculative_algorithm="EAGLE3", speculative_num_steps=5, speculative_eagle_topk=6,
                  speculative_num_draft_tokens=32, **flags)
    assert spec.scheduler.kv.table.table.shape[1] >= 96 + 32
    got = spec.generate(input_ids=prompt, sampling_params=params)
    assert got["output_ids"] == want["output_ids"] and len(want["output_ids"]) >= 30
    assert got["meta_info"]["spec_verify_ct"] > 0
    spec.scheduler.kv.flush_cache()
    spec.scheduler.kv.assert_no_leak()
