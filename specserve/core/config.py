"""Frozen configuration dataclasses, one per subsystem.

This file owns the *shape* of the configuration: every knob the engine reads lives in one
of these dataclasses, with its default. It knows nothing about argparse or validation;
`specserve/args.py` turns a command line into a `Config`, fills the auto-defaults and
rejects invalid combinations. Subsystems take only their own slice (`cfg.cache`,
`cfg.spec`, ...), never the whole object, so a change to one topic stays in one place.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"


class ConfigError(ValueError):
    """A command line or Config the engine must not start with; the message is one line."""


@dataclass(frozen=True)
class ModelConfig:
    model_path: str = DEFAULT_MODEL  # HF dir, .gguf file, catalogue name or hub id
    tokenizer_path: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    trust_remote_code: bool = False
    context_length: int | None = None  # None: the model's max_position_embeddings
    quantization: str | None = None
    served_model_name: str | None = None
    revision: str | None = None
    load_format: str = "auto"


@dataclass(frozen=True)
class CacheConfig:
    mem_fraction_static: float | None = None  # None: auto (GPU only)
    max_total_tokens: int | None = None  # None: auto (GPU: from memory, CPU: a fixed budget)
    page_size: int = 1
    disable_radix_cache: bool = False
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8_e4m3 (cache/kv_pool.py)


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None  # None: auto; -1 disables chunking
    max_prefill_tokens: int = 16384
    schedule_policy: str = "fcfs"
    random_seed: int | None = None
    decode_log_interval: int = 40
    disable_overlap_schedule: bool = False  # overlap decode steps' host work with the GPU (CUDA; spec/pipeline.py too)
    num_continuous_decode_steps: int = 1  # decode steps between looks for new prefills (SGLang's flag)


@dataclass(frozen=True)
class RunnerConfig:
    attention_backend: str | None = None  # None: triton on CUDA, torch on CPU
    cuda_graph_max_bs: int | None = None
    cuda_graph_max_prefill_tokens: int = 4096  # prefill chunks up to this are graphed; 0: none
    disable_cuda_graph: bool = False
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = 32
    # every logit computed with one arithmetic whatever the batch (models/invariant.py)
    enable_deterministic_inference: bool = False
    tp_size: int = 1  # tensor-parallel ranks per replica (engine/ranks.py)
    cpu_threads: int | None = None  # torch's and the C kernels' threads in an engine process; None: its share
    dp_size: int = 1  # engine replicas behind the one HTTP server
    nnodes: int = 1  # hosts one tensor-parallel group spans
    node_rank: int = 0  # this host's index among them (0 serves HTTP)
    dist_init_addr: str | None = None  # "host:port" where the ranks meet (needed with nnodes > 1)
    base_gpu_id: int = 0  # the first GPU this host's ranks use


@dataclass(frozen=True)
class SpecConfig:
    algorithm: str | None = None  # EAGLE | EAGLE3 | STANDALONE | NGRAM (NEXTN -> EAGLE)
    draft_model_path: str | None = None
    draft_model_revision: str | None = None
    draft_load_format: str | None = None
    num_steps: int | None = None
    eagle_topk: int | None = None
    num_draft_tokens: int | None = None
    accept_threshold_single: float = 1.0
    accept_threshold_acc: float = 1.0
    token_map: str | None = None
    attention_mode: str = "prefill"
    draft_attention_backend: str | None = None
    moe_runner_backend: str | None = None
    moe_a2a_backend: str | None = None
    draft_model_quantization: str | None = None
    ngram_min_match_window_size: int = 1
    ngram_max_match_window_size: int = 12
    ngram_min_bfs_breadth: int = 1
    ngram_max_bfs_breadth: int = 10
    ngram_match_type: str = "BFS"
    ngram_branch_length: int = 18
    ngram_capacity: int = 10_000_000
    enable_multi_layer_eagle: bool = False
    enable_spec_v2: bool = False  # from SPECSERVE_ENABLE_SPEC_V2 / SGLANG_ENABLE_SPEC_V2
    ngram_force_greedy_verify: bool = False  # from *_NGRAM_FORCE_GREEDY_VERIFY
    adaptive: str = "auto"  # auto (= on, any device) | on | off: turn speculation down when it does not pay
    # EAGLE step graphs from batch_tree_from requests up draft this smaller tree (spec/eagle/batch_tree.py):
    # auto (the head's own, when the tree flags are omitted) | off | "steps,topk,draft tokens"
    batch_tree: str = "auto"
    batch_tree_from: int = 2  # batch 1 keeps the main tree (spec/eagle/batch_tree.py)
    # The draft's local directory, resolved from the flags and the target before any weights
    # load (spec/registry.py `resolve_spec`): the explicit path, a shipped head or the target itself (MTP)
    draft_dir: str | None = None
    on_cpu: bool = False  # the target is served on the CPU (preflight): a head's CPU tree applies

    @property
    def enabled(self) -> bool:
        return self.algorithm is not None

    @property
    def name(self) -> str:
        """The algorithm, for code that runs only with speculation on."""
        assert self.algorithm is not None, "speculation is off"
        return self.algorithm

    @property
    def tree(self) -> tuple[int, int, int]:
        """(num_steps, eagle_topk, num_draft_tokens) once start-up resolved them (spec/registry.py)."""
        steps, topk, n = self.num_steps, self.eagle_topk, self.num_draft_tokens
        assert steps is not None and topk is not None and n is not None, "the draft tree is resolved at start-up"
        return steps, topk, n

    @property
    def draft_path(self) -> Path:
        """The draft's local directory once start-up resolved it (spec/registry.py)."""
        assert self.draft_dir is not None, "the draft's directory is resolved at start-up"
        return Path(self.draft_dir)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    log_level: str = "info"
    enable_metrics: bool = False
    chat_template: str | None = None  # a jinja file that replaces the model's chat template
    tool_call_parser: str | None = None  # how tool calls are read from the output (server/tool_parsers.py)
    max_request_mb: float = 32.0  # a larger request body is a 413, refused before it is parsed
    max_choices_per_request: int = 256  # prompts x n of one HTTP call; more is a 400
    graceful_shutdown_timeout: float = 5.0  # seconds running requests get after SIGTERM / Ctrl-C
    watchdog_timeout: float = 300.0  # an engine step longer than this stops the server (SGLang's)
    tokenizer_worker_num: int = 1  # HTTP front-end processes sharing the port (SGLang's name)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
