"""Command line -> Config: flags, aliases, SGLang's validation rules and auto-defaults.

Covers specserve/args.py, specserve/args_check.py and specserve/env.py. Every test passes
`device_has_cuda` so no test imports torch or depends on the machine.
"""
from __future__ import annotations

import dataclasses
import logging
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import specserve.args as args
from specserve.args import ConfigError, build_parser, parse_config
from specserve.core import env
from specserve.core.config import Config, SpecConfig
from specserve.spec.registry import resolve_defaults as resolve_spec_defaults

ENV_VARS = ("SPECSERVE_ENABLE_SPEC_V2", "SGLANG_ENABLE_SPEC_V2",
            "SPECSERVE_NGRAM_FORCE_GREEDY_VERIFY", "SGLANG_NGRAM_FORCE_GREEDY_VERIFY")
ALL_ALGOS = frozenset({"EAGLE", "EAGLE3", "STANDALONE", "NGRAM"})

DESIGN_FLAGS = """--model --model-path --tokenizer-path --host --port --dtype --device
--trust-remote-code --context-length --mem-fraction-static --max-running-requests
--max-total-tokens --chunked-prefill-size --page-size --disable-radix-cache --cuda-graph-max-bs
--disable-cuda-graph --enable-torch-compile --torch-compile-max-bs --attention-backend
--quantization --served-model-name --api-key --random-seed --log-level --enable-metrics
--tp-size --dp-size --nnodes --node-rank --dist-init-addr --base-gpu-id --decode-log-interval --max-prefill-tokens --schedule-policy --revision
--load-format""".split()
REFERENCE_FLAGS = """--speculative-algorithm --speculative-draft-model-path
--speculative-draft-model-revision --speculative-draft-load-format --speculative-num-steps
--speculative-eagle-topk --speculative-num-draft-tokens --speculative-accept-threshold-single
--speculative-accept-threshold-acc --speculative-token-map --speculative-attention-mode
--speculative-draft-attention-backend --speculative-moe-runner-backend
--speculative-moe-a2a-backend --speculative-draft-model-quantization
--speculative-ngram-min-match-window-size --speculative-ngram-max-match-window-size
--speculative-ngram-min-bfs-breadth --speculative-ngram-max-bfs-breadth
--speculative-ngram-match-type --speculative-ngram-branch-length --speculative-ngram-capacity
--enable-multi-layer-eagle""".split()
GROUPS = ("Model", "Memory and cache", "Scheduling", "Runtime (kernels, CUDA graphs, compile)",
          "Speculative decoding", "N-gram speculative decoding", "Server and API",
          "Logging and metrics")

EAGLE = ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "d"]
TRIPLE = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
          "--speculative-num-draft-tokens", "6"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)


def cfg(*argv: str, arch: str | None = None, cuda: bool = False) -> Config:
    return parse_config(list(argv), device_has_cuda=cuda, architecture=arch)


def error_of(*argv: str, cuda: bool = False) -> str:
    with pytest.raises(ConfigError) as info:
        cfg(*argv, cuda=cuda)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---- flags, help, aliases -----------------------------------------------------------------

def test_defaults_round_trip() -> None:
    assert cfg() == Config()
    assert cfg().model.model_path == "smollm2-135m"


def test_help_lists_every_flag_group_and_default() -> None:
    text = build_parser().format_help()
    for flag in DESIGN_FLAGS + REFERENCE_FLAGS:
        assert re.search(rf"(^|[\s\[,]){re.escape(flag)}\b(?!-)", text), flag
    for title in GROUPS:
        assert f"\n{title}:\n" in text, title
    assert "embedded default" in text
    flat = " ".join(text.split())
    assert "(default: 30000)" in flat and "(default: 10000000)" in flat
    assert "triton on CUDA, torch on CPU" in flat


def test_every_flag_help_shows_a_default() -> None:
    for action in build_parser()._actions:
        if action.dest != "help":
            assert "(default:" in build_parser()._get_formatter()._get_help_string(action)


def test_every_config_field_has_a_flag() -> None:
    dests = {a.dest for a in build_parser()._actions}
    env_fields = {"enable_spec_v2", "ngram_force_greedy_verify", "draft_dir", "on_cpu"}  # the last two: set at start-up
    for section in Config.__dataclass_fields__:
        cls = type(getattr(Config(), section))
        for name in cls.__dataclass_fields__:
            if name not in env_fields:
                assert name in dests or f"speculative_{name}" in dests, name


def test_model_aliases() -> None:
    assert cfg("--model", "m").model.model_path == cfg("--model-path", "m").model.model_path == "m"


@pytest.mark.parametrize("given_dtype, dtype", [("half", "float16"), ("bf16", "bfloat16"),
                                                 ("float", "float32"), ("fp32", "float32"),
                                                 ("BFloat16", "bfloat16"), ("auto", "auto")])
def test_dtype_aliases(given_dtype: str, dtype: str) -> None:
    assert cfg("--dtype", given_dtype).model.dtype == dtype


def test_algorithm_case_insensitive_and_nextn_is_eagle() -> None:
    assert cfg("--speculative-algorithm", "eagle3", "--speculative-draft-model", "d") \
        .spec.algorithm == "EAGLE3"
    assert cfg("--speculative-algorithm", "NextN").spec.algorithm == "EAGLE"
    assert cfg("--speculative-algorithm", "NGRAM", "--speculative-ngram-match-type", "prob") \
        .spec.ngram_match_type == "PROB"


def test_bool_flags_and_plain_values() -> None:
    c = cfg("--trust-remote-code", "--disable-radix-cache", "--disable-cuda-graph",
            "--enable-metrics", "--port", "8080", "--log-level", "WARNING", "--tp-size", "1",
            "--schedule-policy", "fcfs", "--chunked-prefill-size", "-1")
    assert c.model.trust_remote_code and c.cache.disable_radix_cache
    assert c.runner.disable_cuda_graph and c.server.enable_metrics
    assert (c.server.port, c.server.log_level) == (8080, "warning")
    assert c.scheduler.schedule_policy == "fcfs"
    assert c.scheduler.chunked_prefill_size == -1


@pytest.mark.parametrize("argv,needle", [
    (["--schedule-policy", "lpm"], "--schedule-policy lpm is not implemented yet"),
])
def test_accepted_but_unbuilt_choices_fail_loudly(argv, needle) -> None:
    with pytest.raises(ConfigError, match=needle):
        cfg(*argv)


@pytest.mark.parametrize("argv", [["--dtype", "int4"], ["--device", "tpu"], ["--port", "x"],
                                  ["--attention-backend", "flashinfer"], ["--no-such-flag"],
                                  ["--speculative-algorithm", "MEDUSA"]])
def test_argparse_errors_raise_config_error(argv: list[str]) -> None:
    assert error_of(*argv)


# ---- ConfigError rules --------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--port", "0"], "--port must be in 1..65535, got 0"),
    (["--port", "65536"], "--port must be in 1..65535, got 65536"),
    (["--mem-fraction-static", "1.0"], "--mem-fraction-static must be in (0, 1), got 1.0"),
    (["--mem-fraction-static", "0"], "--mem-fraction-static must be in (0, 1), got 0.0"),
    (["--max-running-requests", "0"], "--max-running-requests must be >= 1, got 0"),
    (["--max-total-tokens", "0"], "--max-total-tokens must be >= 1, got 0"),
    (["--chunked-prefill-size", "0"],
     "--chunked-prefill-size must be -1 (no chunking) or >= 1, got 0"),
    (["--page-size", "0"], "--page-size must be >= 1, got 0"),
    (["--context-length", "0"], "--context-length must be >= 1, got 0"),
    (["--cuda-graph-max-bs", "0"], "--cuda-graph-max-bs must be >= 1, got 0"),
    (["--num-continuous-decode-steps", "0"], "--num-continuous-decode-steps must be >= 1, got 0"),
    (["--cuda-graph-max-prefill-tokens", "-1"],
     "--cuda-graph-max-prefill-tokens must be >= 0 (0: prefill eagerly), got -1"),
    (["--torch-compile-max-bs", "0"], "--torch-compile-max-bs must be >= 1, got 0"),
    (["--tp-size", "0"], "--tp-size must be >= 1, got 0"),
    (["--cpu-threads", "0"], "--cpu-threads must be >= 1, got 0"),
    (EAGLE + ["--speculative-num-steps", "0", "--speculative-eagle-topk", "1",
              "--speculative-num-draft-tokens", "2"],
     "--speculative-num-steps must be >= 1, got 0"),
    (EAGLE + ["--speculative-accept-threshold-single", "0"],
     "--speculative-accept-threshold-single must be in (0, 1], got 0.0"),
    (EAGLE + ["--speculative-accept-threshold-acc", "1.5"],
     "--speculative-accept-threshold-acc must be in (0, 1], got 1.5"),
])
def test_range_errors(argv: list[str], message: str) -> None:
    assert error_of(*argv) == message


NG = ["--speculative-algorithm", "NGRAM"]


P = "--speculative-ngram-"


@pytest.mark.parametrize("argv, message", [
    ([f"{P}branch-length", "1"], f"{P}branch-length must be > 1, got 1"),
    ([f"{P}min-match-window-size", "0"], f"{P}min-match-window-size must be > 0, got 0"),
    ([f"{P}min-match-window-size", "5", f"{P}max-match-window-size", "3"],
     f"{P}min-match-window-size (5) must be <= {P}max-match-window-size (3)"),
    ([f"{P}max-match-window-size", "18"],
     f"{P}max-match-window-size (18) must be < {P}branch-length (18)"),
    ([f"{P}min-bfs-breadth", "0"], f"{P}min-bfs-breadth must be > 0, got 0"),
    ([f"{P}min-bfs-breadth", "4", f"{P}max-bfs-breadth", "2"],
     f"{P}min-bfs-breadth (4) must be <= {P}max-bfs-breadth (2)"),
])
def test_ngram_parameter_errors(argv: list[str], message: str) -> None:
    assert error_of(*NG, *argv) == message


@pytest.mark.parametrize("argv, message", [
    (["--tp-size", "2", "--enable-torch-compile"], "--enable-torch-compile with --tp-size > 1 is not supported yet"),
    (["--tp", "2", "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "d",
      "--speculative-token-map", "m.pt"], "--speculative-token-map with --tp-size > 1 is not supported yet"),
    (["--nnodes", "2", "--tp", "2", "--dist-init-addr", "h:1", "--dp", "2"],
     "--dp-size > 1 with --nnodes > 1 is not supported yet"),
    (["--page-size", "16"], "--page-size 16: page sizes above 1 are not supported yet"),
    (["--quantization", "bitsandbytes"],
     "--quantization bitsandbytes is not supported yet (supported: fp8, awq, gptq, gguf, none)"),
    (EAGLE + ["--speculative-draft-model-quantization", "int8"],
     "--speculative-draft-model-quantization int8 is not supported yet"),
    (["--device", "cuda"], "--device cuda: no CUDA device found"),
    (EAGLE + ["--speculative-moe-runner-backend", "triton"],
     "--speculative-moe-runner-backend is not supported: specserve serves dense models only"),
    (EAGLE + ["--speculative-moe-a2a-backend", "deepep"],
     "--speculative-moe-a2a-backend is not supported: specserve serves dense models only"),
])
def test_unsupported_fails_loudly(argv: list[str], message: str) -> None:
    assert error_of(*argv).startswith(message)


@pytest.mark.parametrize("argv, message", [
    (["--dp-size", "0"], "--dp-size must be >= 1, got 0"),
    (["--nnodes", "2", "--tp", "2"], "--nnodes 2 needs --dist-init-addr host:port"),
    (["--nnodes", "2", "--tp", "3", "--dist-init-addr", "127.0.0.1:5000"],
     "--tp-size 3 must be a multiple of --nnodes 2"),
    (["--nnodes", "2", "--node-rank", "2", "--tp", "2", "--dist-init-addr", "h:1"],
     "--node-rank must be in 0..1 (--nnodes 2), got 2"),
    (["--dist-init-addr", "nowhere"], "--dist-init-addr must be host:port"),
    (["--base-gpu-id", "-1"], "--base-gpu-id must be >= 0, got -1"),
])
def test_parallel_flag_errors(argv: list[str], message: str) -> None:
    assert error_of(*argv).startswith(message)


def test_parallel_flags_take_sglangs_names() -> None:
    cfg = parse_config(["--tp", "4", "--dp", "2", "--base-gpu-id", "1"]).runner
    assert (cfg.tp_size, cfg.dp_size, cfg.base_gpu_id) == (4, 2, 1)
    cfg = parse_config(["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
                        "--dist-init-addr", "10.0.0.1:5000"]).runner
    assert (cfg.tp_size, cfg.nnodes, cfg.node_rank, cfg.dist_init_addr) == (2, 2, 1, "10.0.0.1:5000")


def test_trust_remote_code_is_accepted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="specserve")
    assert cfg("--trust-remote-code").model.trust_remote_code
    assert "--trust-remote-code is not needed" in caplog.text


def test_an_attention_mode_that_changes_nothing_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="specserve")
    assert cfg(*EAGLE, "--speculative-attention-mode", "decode").spec.attention_mode == "decode"
    assert "--speculative-attention-mode decode changes nothing here" in caplog.text


def test_cuda_and_unquant_accepted_when_possible() -> None:
    assert cfg("--device", "cuda", cuda=True).model.device == "cuda"
    c = cfg(*EAGLE, "--speculative-draft-model-quantization", "unquant")
    assert c.spec.draft_model_quantization == "unquant"


NEEDS_ALGO = "requires --speculative-algorithm"


@pytest.mark.parametrize("argv, message", [
    (["--speculative-eagle-topk", "2"], f"--speculative-eagle-topk {NEEDS_ALGO}"),
    (["--speculative-accept-threshold-single", "1.0"],
     f"--speculative-accept-threshold-single {NEEDS_ALGO}"),
    (["--speculative-draft-model", "d"], f"--speculative-draft-model-path {NEEDS_ALGO}"),
    (["--speculative-ngram-capacity", "5"], f"--speculative-ngram-capacity {NEEDS_ALGO}"),
    (["--enable-multi-layer-eagle"], f"--enable-multi-layer-eagle {NEEDS_ALGO}"),
    (EAGLE + ["--speculative-num-steps", "3"], "set all three of --speculative-num-steps, "
     "--speculative-eagle-topk, --speculative-num-draft-tokens, or none for auto-tuning"),
    (["--model", "org/some-model", "--speculative-algorithm", "EAGLE3"],  # the default model ships a head
     "--speculative-algorithm EAGLE3 requires --speculative-draft-model-path"),
    (["--speculative-algorithm", "STANDALONE"],
     "--speculative-algorithm STANDALONE requires --speculative-draft-model-path"),
    (EAGLE + ["--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
              "--speculative-num-draft-tokens", "12"],
     "--speculative-num-draft-tokens 12 is too large for --speculative-num-steps 3 and "
     "--speculative-eagle-topk 2: the draft tree has topk + (steps-1)*topk^2 = 10 candidates, "
     "so num_draft_tokens must be <= 11"),
    (EAGLE + ["--speculative-batch-tree", "3,1"], "--speculative-batch-tree must be off, auto or "
     "STEPS,TOPK,DRAFT_TOKENS (e.g. 3,2,6), got '3,1'"),
    (["--speculative-algorithm", "NGRAM", "--speculative-batch-tree", "3,1,4"],
     "--speculative-batch-tree applies to --speculative-algorithm EAGLE and EAGLE3 only, not NGRAM"),
    (EAGLE + ["--speculative-batch-tree-from", "0"], "--speculative-batch-tree-from must be >= 1, got 0"),
])
def test_speculative_errors(argv: list[str], message: str) -> None:
    assert error_of(*argv) == message


# ---- speculative auto-defaults and post-rules ---------------------------------------------

def triple(spec: SpecConfig) -> tuple[int | None, int | None, int | None]:
    return spec.num_steps, spec.eagle_topk, spec.num_draft_tokens


def test_standalone_auto_is_3_1_4() -> None:
    c = cfg("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "d")
    assert triple(c.spec) == (3, 1, 4)


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
@pytest.mark.parametrize("arch, expected", [("LlamaForCausalLM", (5, 4, 8)),
                                            ("Qwen2ForCausalLM", (3, 1, 4))])
def test_eagle_auto_by_architecture(algo: str, arch: str,
                                     expected: tuple[int, int, int]) -> None:
    argv = ["--speculative-algorithm", algo, "--speculative-draft-model-path", "d"]
    assert triple(cfg(*argv, arch=arch).spec) == expected
    later = cfg(*argv)  # architecture unknown at parse time: the engine resolves it later
    assert triple(later.spec) == (None, None, None)
    assert triple(resolve_spec_defaults(later.spec, arch)) == expected


def test_explicit_triple_is_kept() -> None:
    assert triple(cfg(*EAGLE, *TRIPLE, arch="LlamaForCausalLM").spec) == (3, 2, 6)


def test_ngram_defaults() -> None:
    c = cfg(*NG)
    assert (c.spec.eagle_topk, c.spec.num_draft_tokens) == (10, 12)
    c = cfg(*NG, "--speculative-ngram-max-bfs-breadth", "4", "--speculative-num-draft-tokens", "16")
    assert (c.spec.eagle_topk, c.spec.num_draft_tokens) == (4, 16)


def test_topk_1_adjusts_draft_tokens(caplog: pytest.LogCaptureFixture) -> None:
    c = cfg(*EAGLE, "--speculative-num-steps", "4", "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", "16")
    assert c.spec.num_draft_tokens == 5
    assert ("speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when "
            "speculative_eagle_topk == 1") in caplog.text


def test_max_running_requests_48(caplog: pytest.LogCaptureFixture) -> None:
    assert cfg(*NG).scheduler.max_running_requests == 48
    assert "Max running requests is reset to 48 for speculative decoding." in caplog.text
    assert cfg(*NG, "--max-running-requests", "7").scheduler.max_running_requests == 7
    assert cfg().scheduler.max_running_requests is None


def test_draft_revision_defaults_to_main() -> None:
    assert cfg(*EAGLE).spec.draft_model_revision == "main"
    assert cfg(*EAGLE, "--speculative-draft-model-revision", "v2").spec.draft_model_revision == "v2"
    # EAGLE without a draft is allowed here: whether the model has MTP layers is decided later.
    assert cfg("--speculative-algorithm", "EAGLE").spec.draft_model_path is None


def test_token_map_ignored_for_eagle3(caplog: pytest.LogCaptureFixture) -> None:
    cfg("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d",
        "--speculative-token-map", "freq.pt")
    assert ("--speculative-token-map is ignored for EAGLE3: EAGLE3 models already have a draft "
            "vocabulary") in caplog.text


def test_token_map_is_taken_by_eagle_and_standalone_and_refused_elsewhere(monkeypatch) -> None:
    from specserve.spec import registry

    flags = ("--speculative-draft-model-path", "d", "--speculative-token-map", "freq.pt")
    assert cfg("--speculative-algorithm", "STANDALONE", *flags).spec.token_map == "freq.pt"
    refusing = dataclasses.replace(registry.get("STANDALONE"), token_map="refused")  # as a plug-in may
    monkeypatch.setitem(registry._ALGORITHMS, "STANDALONE", refusing)
    assert error_of("--speculative-algorithm", "STANDALONE", *flags) == (
        "--speculative-token-map (FR-Spec) is supported for --speculative-algorithm EAGLE only")


def test_dummy_draft_weights_are_for_standalone_only() -> None:
    dummy = ("--speculative-draft-model-path", "d", "--speculative-draft-load-format", "dummy")
    assert cfg("--speculative-algorithm", "STANDALONE", *dummy).spec.draft_load_format == "dummy"
    assert error_of("--speculative-algorithm", "EAGLE3", *dummy) == (
        "--speculative-draft-load-format dummy is supported for --speculative-algorithm STANDALONE only "
        "(a draft LLM of random weights, for benchmarks)")


def test_attention_backends_are_accepted() -> None:
    assert cfg("--attention-backend", "triton").runner.attention_backend == "triton"
    for name in ("torch", "triton"):
        assert cfg(*EAGLE, "--speculative-draft-attention-backend", name).spec.draft_attention_backend == name


def test_lossy_threshold_warns(caplog: pytest.LogCaptureFixture) -> None:
    cfg(*EAGLE, "--speculative-accept-threshold-single", "0.5")
    assert "verification is no longer lossless" in caplog.text


def test_ngram_on_cpu_is_allowed_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="specserve")
    assert cfg(*NG, "--device", "cpu").spec.algorithm == "NGRAM"
    assert "NGRAM speculative decoding runs on CPU" in caplog.text


@settings(max_examples=60, deadline=None)
@given(steps=st.integers(1, 8), topk=st.integers(1, 8), n=st.integers(1, 80))
def test_resolved_tree_always_fits(steps: int, topk: int, n: int) -> None:
    spec = SpecConfig(algorithm="EAGLE", num_steps=steps, eagle_topk=topk, num_draft_tokens=n)
    try:
        out = resolve_spec_defaults(spec, None)
    except ConfigError:
        assert topk > 1 and n - 1 > topk + (steps - 1) * topk * topk
        return
    assert out.num_draft_tokens - 1 <= topk + (steps - 1) * topk * topk
    assert topk > 1 or out.num_draft_tokens == steps + 1
    assert resolve_spec_defaults(out, "LlamaForCausalLM") == out  # idempotent


# ---- SpecV2 and the environment -----------------------------------------------------------

def test_spec_v2_rejects_explicit_topk_above_1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_ENABLE_SPEC_V2", "True")
    assert error_of(*EAGLE, *TRIPLE) == (
        "Spec v2 currently only supports topk = 1 for speculative decoding.")
    c = cfg(*EAGLE, "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", "4")
    assert c.spec.enable_spec_v2 and c.spec.eagle_topk == 1


def test_spec_v2_omitted_topk_is_not_caught_before_auto_tune(
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # As in SGLang (and as its docs warn): the check runs on the typed topk, before
    # auto-tuning, so Llama's auto topk=4 gets through. We only warn.
    monkeypatch.setenv("SPECSERVE_ENABLE_SPEC_V2", "1")
    c = cfg(*EAGLE, arch="LlamaForCausalLM")
    assert c.spec.eagle_topk == 4
    assert "Spec v2 only supports topk = 1" in caplog.text


def test_spec_v2_rejects_ngram(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_ENABLE_SPEC_V2", "yes")
    assert error_of(*NG).startswith("Spec v2 does not support NGRAM speculative decoding")


@pytest.mark.parametrize("raw, value", [("1", True), ("true", True), ("True", True), ("YES", True),
                                        ("y", True), ("0", False), ("false", False), ("no", False),
                                        ("", False)])
def test_env_truthy_parsing(monkeypatch: pytest.MonkeyPatch, raw: str, value: bool) -> None:
    monkeypatch.setenv("SPECSERVE_NGRAM_FORCE_GREEDY_VERIFY", raw)
    assert env.ngram_force_greedy_verify() is value


def test_env_aliases_and_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env.spec_v2_enabled() is False
    monkeypatch.setenv("SGLANG_ENABLE_SPEC_V2", "True")
    monkeypatch.setenv("SGLANG_NGRAM_FORCE_GREEDY_VERIFY", "1")
    assert env.spec_v2_enabled() and env.ngram_force_greedy_verify()
    assert cfg().spec.ngram_force_greedy_verify
    monkeypatch.setenv("SPECSERVE_ENABLE_SPEC_V2", "false")  # the SPECSERVE_ name wins
    assert env.spec_v2_enabled() is False


def test_invalid_env_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_ENABLE_SPEC_V2", "ture")
    with pytest.raises(ValueError, match="SGLANG_ENABLE_SPEC_V2"):
        env.spec_v2_enabled()
    assert "SGLANG_ENABLE_SPEC_V2" in error_of()


# ---- implementation gate ------------------------------------------------------------------

@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"])
def test_every_algorithm_is_implemented(algo: str) -> None:
    assert cfg("--speculative-algorithm", algo, "--speculative-draft-model-path", "d").spec.algorithm \
        == ("EAGLE" if algo == "NEXTN" else algo)


def test_gated_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cfg("--enable-torch-compile", "--torch-compile-max-bs", "8").runner.enable_torch_compile
    assert error_of(*EAGLE, "--enable-multi-layer-eagle") == (
        "--enable-multi-layer-eagle is not implemented yet")
    monkeypatch.setattr(args, "IMPLEMENTED_FLAGS", frozenset({"--enable-multi-layer-eagle"}))
    assert cfg(*EAGLE, "--enable-multi-layer-eagle").spec.enable_multi_layer_eagle
