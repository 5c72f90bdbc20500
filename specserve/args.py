"""The command line: SGLang-compatible flags in, a checked frozen `Config` out.

This file owns the flag declarations (names, types, choices, defaults and help, grouped the way
`--help` shows them), the mapping from flags to the `Config` dataclasses, and the gate that
refuses features the engine does not implement yet. Defaults come from `specserve/config.py`,
so the two never drift; the rules that validate and auto-fill a Config live in
`specserve/args_check.py`. It does not know how anything is served.

Bad command lines raise `ConfigError` (argparse's own errors included, see `_Parser`); the
launcher prints the one-line message and exits with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

from specserve.args_check import CheckContext, check_config  # re-exported: the public API is specserve.args
from specserve.core import env
from specserve.core.config import (
    CacheConfig,
    Config,
    ConfigError,
    ModelConfig,
    RunnerConfig,
    SchedulerConfig,
    ServerConfig,
    SpecConfig,
)
from specserve.server.tool_parsers import TOOL_CALL_PARSERS
from specserve.spec import registry

__all__ = ["ConfigError", "CheckContext", "build_parser", "parse_config", "check_config",
           "check_implemented", "IMPLEMENTED_FLAGS"]

# Implementation gates: a flag goes here in the same change that makes it work. (Every
# registered speculative algorithm is implemented: spec/registry.py.)
IMPLEMENTED_FLAGS: frozenset[str] = frozenset()
_GATED_FLAGS: dict[str, Callable[[Config], bool]] = {
    "--enable-multi-layer-eagle": lambda c: c.spec.enable_multi_layer_eagle,
    "--schedule-policy lpm": lambda c: c.scheduler.schedule_policy == "lpm",
}

_M, _C, _S, _R, _P, _V = (ModelConfig(), CacheConfig(), SchedulerConfig(), RunnerConfig(),
                          SpecConfig(), ServerConfig())
_DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16",
                  "float": "float32", "fp32": "float32"}
_AUTO = "(default: None, auto-chosen when omitted)"


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of exiting, so the Engine API can catch it."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" unless the help already explains its default in words."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and "(default:" in action.help:
            return action.help
        return super()._get_help_string(action)


def positive_int(value: str) -> int:
    """An argparse type: an integer of at least 1 (the train-draft and bench command lines)."""
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return n


def _dtype(value: str) -> str:
    value = value.lower()
    return _DTYPE_ALIASES.get(value, value)


def _add_model(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Model")
    g.add_argument("--model-path", "--model", dest="model_path", default=_M.model_path,
                   help="HF directory, .gguf file, catalogue name or hub id "
                        "(default: %(default)s, the embedded default model)")
    g.add_argument("--tokenizer-path", default=_M.tokenizer_path,
                   help="tokenizer directory or hub id, if not the model's")
    g.add_argument("--revision", default=_M.revision, help="hub revision (branch, tag or commit)")
    g.add_argument("--load-format", default=_M.load_format, choices=("auto", "safetensors", "gguf", "dummy"),
                   help="weight format; dummy: random weights of the model's shape, nothing read "
                        "(benchmarks)")
    g.add_argument("--dtype", type=_dtype, default=_M.dtype,
                   choices=("auto", "float32", "bfloat16", "float16"),
                   help="weight and activation dtype; half, fp16, bf16, float and fp32 are "
                        "accepted")
    g.add_argument("--device", default=_M.device, choices=("auto", "cpu", "cuda"),
                   help="auto picks cuda when a GPU is present, else cpu")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for SGLang compatibility; not needed for built-in architectures")
    g.add_argument("--context-length", type=int, default=_M.context_length,
                   help="maximum context length "
                        "(default: None, the model's max_position_embeddings)")
    g.add_argument("--quantization", default=_M.quantization,
                   help="weight quantization: fp8, awq, gptq; gguf (a GGUF's own blocks, on the CPU or a GPU; "
                        "the CPU's default); none (float weights, a GGUF dequantized: a GPU's default)")
    g.add_argument("--served-model-name", default=_M.served_model_name,
                   help="model name reported by the API (default: None, the model path)")


def _add_memory(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Memory and cache")
    g.add_argument("--mem-fraction-static", type=float, default=_C.mem_fraction_static,
                   help="fraction of GPU memory for weights and KV cache "
                        "(default: None, computed from free GPU memory)")
    g.add_argument("--max-total-tokens", type=int, default=_C.max_total_tokens,
                   help="KV cache size in tokens "
                        "(default: None, from memory on GPU, a fixed budget on CPU)")
    g.add_argument("--page-size", type=int, default=_C.page_size, help="tokens per KV cache page")
    g.add_argument("--disable-radix-cache", action="store_true", help="disable prefix caching")
    g.add_argument("--kv-cache-dtype", default=_C.kv_cache_dtype,
                   help="KV cache dtype: auto (the model's) or fp8_e4m3 (alias: fp8)")


def _add_scheduling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Scheduling")
    g.add_argument("--max-running-requests", type=int, default=_S.max_running_requests,
                   help="maximum concurrent requests "
                        "(default: None, auto; 48 with speculative decoding)")
    g.add_argument("--chunked-prefill-size", type=int, default=_S.chunked_prefill_size,
                   help="maximum tokens per prefill chunk, -1 disables chunking "
                        "(default: None, auto)")
    g.add_argument("--max-prefill-tokens", type=int, default=_S.max_prefill_tokens,
                   help="maximum tokens in one prefill batch")
    g.add_argument("--schedule-policy", default=_S.schedule_policy, choices=("fcfs", "lpm"),
                   help="request order: first come first served, or longest prefix match")
    g.add_argument("--random-seed", type=int, default=_S.random_seed, help="random seed")
    g.add_argument("--disable-overlap-schedule", action="store_true",
                   help="read each decode step's tokens back before launching the next (by default, on "
                        "CUDA, the next plain step, or the next greedy EAGLE/EAGLE3/MTP step, is launched first)")
    g.add_argument("--num-continuous-decode-steps", type=int, default=_S.num_continuous_decode_steps,
                   help="decode steps run in a row before new requests are admitted again: more "
                        "throughput when requests end often (fewer prefill steps between them), a "
                        "longer time to first token (default: 1, admit at every step)")


def _add_runtime(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Runtime (kernels, CUDA graphs, compile)")
    g.add_argument("--attention-backend", default=_R.attention_backend, choices=("torch", "triton"),
                   help="attention kernels (default: None, triton on CUDA, torch on CPU)")
    g.add_argument("--cuda-graph-max-bs", type=int, default=_R.cuda_graph_max_bs,
                   help="largest batch captured in a CUDA graph; no effect on CPU "
                        "(default: None, auto)")
    g.add_argument("--cuda-graph-max-prefill-tokens", type=int, default=_R.cuda_graph_max_prefill_tokens,
                   help="prefill chunks of up to this many tokens (one request's or up to 64 "
                        "requests') replay CUDA graphs captured at bucketed lengths; 0 prefills "
                        "eagerly (default: %(default)s)")
    g.add_argument("--disable-cuda-graph", action="store_true", help="disable CUDA graphs")
    g.add_argument("--enable-torch-compile", action="store_true",
                   help="enable torch.compile for kernel-level optimizations")
    g.add_argument("--torch-compile-max-bs", type=int, default=_R.torch_compile_max_bs,
                   help="maximum batch size for torch.compile")
    g.add_argument("--cpu-threads", type=int, default=_R.cpu_threads,
                   help="threads each engine process computes with on the CPU (torch's and the GGUF "
                        "kernels'; default: None, the host's cores shared among its engine processes)")
    g.add_argument("--enable-deterministic-inference", action="store_true",
                   help="batch-invariant kernels: a request's logits do not depend on its batch or on how "
                        "many of its tokens a forward holds, so greedy speculative output equals plain "
                        "decoding bit for bit (slower; docs/architecture.md)")
    _add_parallel(p)


def _add_parallel(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Parallelism (tensor, data, hosts)")
    g.add_argument("--tp-size", "--tp", "--tensor-parallel-size", dest="tp_size", type=int,
                   default=_R.tp_size, help="tensor-parallel size: GPUs (or CPU processes) one model is sharded over")
    g.add_argument("--dp-size", "--dp", "--data-parallel-size", dest="dp_size", type=int, default=_R.dp_size,
                   help="data-parallel size: engine replicas (each --tp-size GPUs) behind the one server, "
                        "requests routed by load and shared prefix")
    g.add_argument("--nnodes", type=int, default=_R.nnodes, help="hosts one tensor-parallel group spans")
    g.add_argument("--node-rank", type=int, default=_R.node_rank,
                   help="this host's index among --nnodes; node 0 serves HTTP, the others run their ranks only")
    g.add_argument("--dist-init-addr", "--nccl-init-addr", dest="dist_init_addr", default=_R.dist_init_addr,
                   help="host:port where the ranks of a multi-node group meet (port + 1 carries the hosts' "
                        "heartbeats); required with --nnodes > 1 (default: None, a free local port)")
    g.add_argument("--base-gpu-id", type=int, default=_R.base_gpu_id,
                   help="the first GPU this host's ranks use")


def _add_speculative(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Speculative decoding")
    g.add_argument("--speculative-algorithm", type=str.upper, default=_P.algorithm,
                   choices=registry.names(), help=_algorithms_help())
    g.add_argument("--speculative-draft-model-path", "--speculative-draft-model",
                   dest="speculative_draft_model_path", default=_P.draft_model_path,
                   help="the draft: an EAGLE-2 / EAGLE-3 head, or a draft LLM for STANDALONE (HF directory, "
                        ".gguf, catalogue name or hub id). Required for STANDALONE; EAGLE3 may omit it for "
                        "a catalogue model with a shipped head (smollm2-135m), EAGLE for a target with MTP "
                        "layers (they are the draft)")
    g.add_argument("--speculative-draft-model-revision", default=_P.draft_model_revision,
                   help="draft model revision (default: None, \"main\" when a draft path is set)")
    g.add_argument("--speculative-draft-load-format", default=_P.draft_load_format,
                   choices=("auto", "safetensors", "gguf", "dummy"),
                   help="draft model weight format (dummy: random weights of its config.json, STANDALONE only)")
    _add_draft_tree(g)
    g.add_argument("--speculative-token-map", default=_P.token_map,
                   help="FR-Spec high-frequency token map (ignored for EAGLE3)")
    g.add_argument("--speculative-draft-attention-backend", default=_P.draft_attention_backend,
                   choices=("torch", "triton"),
                   help="attention backend of the draft model (default: None, same as target)")
    dense_only = "(not supported: specserve serves dense models only)"
    g.add_argument("--speculative-moe-runner-backend", default=_P.moe_runner_backend,
                   help=f"MoE runner backend for the draft model {dense_only}")
    g.add_argument("--speculative-moe-a2a-backend", default=_P.moe_a2a_backend,
                   help=f"MoE all-to-all backend for the draft model {dense_only}")
    g.add_argument("--speculative-draft-model-quantization", default=_P.draft_model_quantization,
                   help="draft quantization, \"unquant\" for none (default: None, same as target)")
    g.add_argument("--enable-multi-layer-eagle", action="store_true",
                   help="enable multi-layer EAGLE")


def _algorithms_help() -> str:
    parts = [f"{a.name}{' (alias ' + ', '.join(a.aliases) + ')' if a.aliases else ''}: {a.summary}"
             for a in registry.algorithms()]
    return "speculative algorithm, case-insensitive; " + "; ".join(parts)


def _add_draft_tree(g: argparse._ArgumentGroup) -> None:
    """The tree shape and the accept rule, in the reference page's order."""
    g.add_argument("--speculative-num-steps", type=int, default=_P.num_steps,
                   help=f"autoregressive drafting depth {_AUTO}")
    g.add_argument("--speculative-eagle-topk", type=int, default=_P.eagle_topk,
                   help=f"branching factor per drafting step {_AUTO}")
    g.add_argument("--speculative-num-draft-tokens", type=int, default=_P.num_draft_tokens,
                   help="draft tokens verified per step; steps + 1 when topk is 1 " + _AUTO)
    g.add_argument("--speculative-accept-threshold-single", type=float,
                   default=_P.accept_threshold_single,
                   help="accept a draft token outright if its target probability is at least "
                        "this (< 1.0 is lossy)")
    g.add_argument("--speculative-accept-threshold-acc", type=float,
                   default=_P.accept_threshold_acc,
                   help="accumulated acceptance threshold (< 1.0 is lossy)")
    g.add_argument("--speculative-adaptive", default=_P.adaptive, choices=("auto", "on", "off"),
                   help="measure speculative and plain steps per batch size and run the faster "
                        "(both are exact); auto: on, on every device (specserve's own flag)")
    g.add_argument("--speculative-batch-tree", default=_P.batch_tree,
                   help="EAGLE: the smaller tree (steps,topk,draft tokens) that batches of "
                        "--speculative-batch-tree-from requests and more draft; off, or auto: the head's "
                        "own when the tree flags are omitted (specserve's own flag)")
    g.add_argument("--speculative-batch-tree-from", type=int, default=_P.batch_tree_from,
                   help="the batch size from which --speculative-batch-tree is drafted")
    g.add_argument("--speculative-attention-mode", default=_P.attention_mode,
                   choices=("prefill", "decode"),
                   help="attention mode for speculative operations (the torch backend runs verify "
                        "and draft extend with one kernel in either mode)")


def _add_ngram(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("N-gram speculative decoding")
    g.add_argument("--speculative-ngram-min-match-window-size", type=int,
                   default=_P.ngram_min_match_window_size, help="minimum n-gram matching window")
    g.add_argument("--speculative-ngram-max-match-window-size", type=int,
                   default=_P.ngram_max_match_window_size,
                   help="maximum n-gram matching window; also the default number of draft tokens")
    g.add_argument("--speculative-ngram-min-bfs-breadth", type=int,
                   default=_P.ngram_min_bfs_breadth, help="minimum BFS breadth")
    g.add_argument("--speculative-ngram-max-bfs-breadth", type=int,
                   default=_P.ngram_max_bfs_breadth, help="maximum BFS breadth (the tree's topk)")
    g.add_argument("--speculative-ngram-match-type", type=str.upper, default=_P.ngram_match_type,
                   choices=("BFS", "PROB"), help="BFS (recency) or PROB (frequency)")
    g.add_argument("--speculative-ngram-branch-length", type=int,
                   default=_P.ngram_branch_length, help="recent tokens inserted into the cache")
    g.add_argument("--speculative-ngram-capacity", type=int, default=_P.ngram_capacity,
                   help="cache capacity in trie nodes")


def _add_server(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Server and API")
    g.add_argument("--host", default=_V.host, help="address to listen on")
    g.add_argument("--port", type=int, default=_V.port, help="port to listen on")
    g.add_argument("--api-key", default=_V.api_key, help="API key clients must send")
    g.add_argument("--chat-template", default=_V.chat_template,
                   help="jinja file that replaces the model's chat template (default: None, the model's own)")
    g.add_argument("--tool-call-parser", default=_V.tool_call_parser,
                   help=f"format of the model's tool calls ({', '.join(TOOL_CALL_PARSERS)}), for `tools` "
                        "in chat requests (default: None, chat requests that need one are refused)")
    g.add_argument("--max-request-mb", type=float, default=_V.max_request_mb,
                   help="largest request body in MiB; a larger one is answered 413 before it is read")
    g.add_argument("--max-choices-per-request", type=int, default=_V.max_choices_per_request,
                   help="most engine requests one HTTP call may create (prompts x n); more is a 400")
    g.add_argument("--graceful-shutdown-timeout", type=float, default=_V.graceful_shutdown_timeout,
                   help="seconds running requests may take to finish after SIGTERM or Ctrl-C; the rest "
                        "are aborted (finish reason abort)")
    g.add_argument("--watchdog-timeout", type=float, default=_V.watchdog_timeout,
                   help="seconds an engine step may take; a longer one (a hang) stops the server with an error")
    g.add_argument("--tokenizer-worker-num", type=int, default=_V.tokenizer_worker_num,
                   help="HTTP front-end processes on the one port, each parsing, tokenizing and streaming "
                        "its own requests to every engine replica (default: 1)")


def _add_logging(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Logging and metrics")
    g.add_argument("--log-level", type=str.lower, default=_V.log_level,
                   choices=("debug", "info", "warning", "error"), help="log level")
    g.add_argument("--decode-log-interval", type=int, default=_S.decode_log_interval,
                   help="decode steps between decode log lines")
    g.add_argument("--enable-metrics", action="store_true",
                   help="expose Prometheus metrics at /metrics")


def build_parser() -> argparse.ArgumentParser:
    """The full SGLang-compatible parser; its errors raise ConfigError."""
    parser = _Parser(prog="specserve", formatter_class=_HelpFormatter,
                     description="specserve: an LLM server with speculative decoding. "
                     "Environment: SPECSERVE_ENABLE_SPEC_V2, SPECSERVE_NGRAM_FORCE_GREEDY_VERIFY "
                     "(SGLANG_ spellings accepted).")
    for add in (_add_model, _add_memory, _add_scheduling, _add_runtime, _add_speculative,
                _add_ngram, _add_server, _add_logging):
        add(parser)
    return parser


def _explicit_flags(argv: Sequence[str]) -> dict[str, str]:
    """dest -> flag for the flags the user typed, whatever value they gave (defaults included)."""
    probe = build_parser()
    flag_of = {}
    for action in probe._actions:  # argparse has no public API for "was this flag given"
        flag_of[action.dest] = action.option_strings[0] if action.option_strings else action.dest
        action.default = argparse.SUPPRESS
    return {dest: flag_of[dest] for dest in vars(probe.parse_args(argv))}


def _section(cls: type, values: dict[str, Any], prefix: str = "", **extra: Any) -> Any:
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {n: values[prefix + n] for n in names if prefix + n in values}
    kwargs.update({n: values[n] for n in names if n in values and n not in kwargs})
    return cls(**kwargs, **extra)


def _to_config(values: dict[str, Any]) -> Config:
    try:
        spec_env = {"enable_spec_v2": env.spec_v2_enabled(),
                    "ngram_force_greedy_verify": env.ngram_force_greedy_verify()}
    except ValueError as e:  # keep one error type for everything the user got wrong
        raise ConfigError(str(e)) from None
    return Config(
        model=_section(ModelConfig, values), cache=_section(CacheConfig, values),
        scheduler=_section(SchedulerConfig, values), runner=_section(RunnerConfig, values),
        spec=_section(SpecConfig, values, prefix="speculative_", **spec_env),
        server=_section(ServerConfig, values),
    )


def check_implemented(config: Config) -> Config:
    """Refuse flags whose feature is not built yet; the last rule `parse_config` applies."""
    for flag, is_set in _GATED_FLAGS.items():
        if is_set(config) and flag not in IMPLEMENTED_FLAGS:
            raise ConfigError(f"{flag} is not implemented yet")
    return config


def parse_config(argv: list[str] | None = None, *, device_has_cuda: bool | None = None,
                 architecture: str | None = None) -> Config:
    """Parse, validate and auto-fill a command line (sys.argv[1:] when argv is None).

    `device_has_cuda` None means "ask torch if a rule needs to know"; `architecture` is the
    target's HF `architectures[0]` if already known (else start-up resolves the algorithm's
    defaults once it has read the model: spec/registry.py `plan`).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    values = vars(build_parser().parse_args(argv))
    ctx = CheckContext(explicit=_explicit_flags(argv), device_has_cuda=device_has_cuda,
                       architecture=architecture)
    return check_implemented(check_config(_to_config(values), ctx))
