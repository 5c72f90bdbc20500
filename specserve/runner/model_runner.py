"""ModelRunner: owns the model, its KV pool and attention backend; runs forwards.

It turns a ScheduleBatch into a ForwardBatch (device tensors), runs the model under
inference mode and returns the logits of the rows the scheduler wants. It decides the
KV budget (how many token slots fit) but not who gets them (that is `KVManager`).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from specserve.attention.base import AttentionBackend
from specserve.attention.torch_ref import TorchRefBackend
from specserve.cache.kv_pool import KVPool
from specserve.core import parallel
from specserve.core.batch import ScheduleBatch
from specserve.core.config import CacheConfig, ModelConfig, RunnerConfig
from specserve.core.forward_batch import ForwardBatch, ForwardMode
from specserve.core.h2d import h2d_many
from specserve.core.request import Req
from specserve.models.compile import CompiledForward
from specserve.models.llama import LlamaForCausalLM
from specserve.models.loader import load_model, pick_dtype, random_model, read_hf_config
from specserve.runner.cuda_graph import CudaGraphRunner
from specserve.runner.memory import OOM_ADVICE, auto_mem_fraction, kv_cache_dtype
from specserve.runner.prefill_graphs import PrefillGraphs
from specserve.runner.sample_graphs import SampleGraphs
from specserve.runner.sampler import SampleOutput, sample, sampling_batch

logger = logging.getLogger("specserve")

CPU_KV_BUDGET_BYTES = 2 << 30  # a fixed KV budget on CPU (no memory profiling there)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def make_backend(name: str | None, device: torch.device, invariant: bool = False) -> AttentionBackend:
    """`name` None: Triton on CUDA (when triton is installed), the torch reference on CPU;
    `invariant`: their batch-invariant forms (--enable-deterministic-inference)."""
    if name is None:
        name = "triton" if device.type == "cuda" and _has_triton() else "torch"
    if name == "torch":
        return TorchRefBackend(float64=invariant)
    if name == "triton":
        from specserve.attention.triton_backend import InvariantTritonBackend, TritonBackend

        return InvariantTritonBackend() if invariant else TritonBackend()
    raise ValueError(f"attention backend {name!r} is not available (available: torch, triton)")


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class ModelRunner:
    def __init__(self, model_dir: Path, model_cfg: ModelConfig, cache_cfg: CacheConfig,
                 runner_cfg: RunnerConfig, model: LlamaForCausalLM | None = None,
                 chunked_prefill_size: int | None = None, draft_headroom_mb: int = 0,
                 draft_kv_shape: tuple[int, int, int] | None = None) -> None:
        """`model`: an already built model for `model_dir`'s config; by default the weights
        are loaded from `model_dir` (random ones with --load-format dummy). The chunk size and
        a draft's headroom only size the GPU memory headroom (`memory.py`); `draft_kv_shape`
        (layers, KV heads, head dim) is a draft's own KV pool, one slot per target slot,
        which the KV budget counts in (engine/speculation.py SpecNeeds)."""
        self.chunked_prefill_size, self.draft_headroom_mb = chunked_prefill_size, draft_headroom_mb
        self.draft_kv_shape = draft_kv_shape
        self.device = pick_device(model_cfg.device)
        if runner_cfg.cpu_threads:
            torch.set_num_threads(runner_cfg.cpu_threads)
        self.model_dir = Path(model_dir)
        hf = read_hf_config(model_dir)
        self.dtype = pick_dtype(model_cfg.dtype, self.device, hf)
        load = random_model if model_cfg.load_format == "dummy" else load_model
        if model is None and load is load_model:  # an invariant model on a GPU: blocks with half activations only
            det_fp32 = self.device.type == "cuda" and self.dtype == torch.float32
            model = load_model(model_dir, self.dtype, self.device, model_cfg.quantization,
                               gguf_ok=not (runner_cfg.enable_deterministic_inference and det_fp32),
                               private=runner_cfg.dp_size == 1)  # replicas share the CPU's layouts
        self.model = model or load(model_dir, self.dtype, self.device, model_cfg.quantization)
        if runner_cfg.enable_torch_compile:
            self.model.compiled = CompiledForward(self.model.forward_eager, runner_cfg.torch_compile_max_bs)
            if self.device.type == "cuda":
                logger.warning("--enable-torch-compile: batches of up to %d requests run torch-native ops "
                               "compiled by inductor in place of the fused kernels, which measured faster "
                               "(docs/benchmarks.md, bench compile)", runner_cfg.torch_compile_max_bs)
        cfg = self.model.config
        self.vocab_size = cfg.vocab_size
        self.context_length = model_cfg.context_length or cfg.max_position_embeddings
        if self.context_length > cfg.max_position_embeddings:
            raise ValueError(f"--context-length {self.context_length} exceeds the model's "
                             f"max_position_embeddings {cfg.max_position_embeddings}")
        self.runner_cfg_max_bs = runner_cfg.cuda_graph_max_bs
        self.kv_dtype = kv_cache_dtype(cache_cfg.kv_cache_dtype, self.dtype, self.device)  # drafts' pools too
        self.num_slots = self._kv_budget(cache_cfg)
        self.kv_pool = KVPool(self.num_slots, cfg.num_layers, cfg.kv_heads_per_rank, cfg.head_dim,
                              self.kv_dtype, self.device)
        k_gb = self.kv_pool.k[0].numel() * self.kv_dtype.itemsize * cfg.num_layers / (1 << 30)  # V: the same
        logger.info("KV cache is allocated. #tokens: %d, dtype: %s, K size: %.2f GB, V size: %.2f GB",
                    self.num_slots, str(self.kv_dtype).removeprefix("torch."), k_gb, k_gb)
        self.attn_backend_name = runner_cfg.attention_backend
        invariant = runner_cfg.enable_deterministic_inference
        if invariant:
            self.model.make_invariant()
        self.attn_backend = make_backend(runner_cfg.attention_backend, self.device, invariant)
        self.feature_mode: str | None = None  # what forward_with_features returns (EAGLE drafts)
        self.graphs: CudaGraphRunner | None = None
        self.sample_graphs: SampleGraphs | None = None  # a decode step's seeded sampling, replayed
        self.prefill_graphs: PrefillGraphs | None = None  # prefill chunks (one request or several)
        self._aranges: dict[int, torch.Tensor] = {}  # arange(n) on the device, by n (`arange`)
        self.runner_cfg = runner_cfg

    # Extend lengths whose query blocks cover every extend-kernel variant (BLOCK_M 16, 32, 64).
    WARM_EXTEND_LENS = (8, 24, 48)

    @torch.inference_mode()
    def warm_up_kernels(self, req_to_token: torch.Tensor) -> None:
        """Compile the Triton extend kernel's variants now, not while serving.

        Its query block follows the longest extend in a batch, so a request that borrows
        a long cached prefix and extends a few tokens meets a variant no earlier prefill
        used, and pays a Triton compile of seconds mid-traffic (likewise an eager verify's
        tree-mask variants). One dummy EXTEND (and tree VERIFY) per variant over a
        fresh request (prefix 0, table row 0, every K/V into the scratch slot 0, which
        the table's zeros point to) compiles them at start-up. Drafts with the target's
        head layout reuse the same compiled variants."""
        if self.device.type != "cuda" or not self.attn_backend.supports_cuda_graph:
            return
        for n in self.WARM_EXTEND_LENS:
            zeros = torch.zeros(n, dtype=torch.int64, device=self.device)
            full = torch.ones(n, n, dtype=torch.bool, device=self.device)
            for mode, masks in ((ForwardMode.EXTEND, None), (ForwardMode.VERIFY, [full])):  # causal, tree
                fb = ForwardBatch(mode, zeros, torch.arange(n, device=self.device), zeros,
                                  torch.zeros(1, dtype=torch.int64, device=self.device), [0], [n], req_to_token,
                                  self.kv_pool, self.attn_backend, custom_masks=masks,
                                  logit_rows=torch.tensor([n - 1], device=self.device))
                fb.attn_backend.init_forward_metadata(fb)
                # the attention variants warm up; compiling these shapes would serve no graph
                self.model.forward_eager(fb)
        torch.cuda.synchronize(self.device)

    def capture_cuda_graphs(self, req_to_token: torch.Tensor, max_running: int, verify_tokens: int = 0) -> None:
        """Capture decode graphs, and verify graphs of `verify_tokens` nodes per request when
        speculating (CUDA, unless --disable-cuda-graph), once the table and draft exist."""
        cfg = self.runner_cfg
        if self.device.type != "cuda" or cfg.disable_cuda_graph:
            return
        if not self.attn_backend.supports_cuda_graph:
            logger.warning("attention backend %s cannot run in CUDA graphs: decoding runs eagerly",
                           type(self.attn_backend).__name__)
            return
        max_bs = self.graph_max_bs(max_running)
        self.graphs = CudaGraphRunner(self.model, self.attn_backend, self.vocab_size, self.device, max_bs,
                                      verify_tokens, self.feature_mode)
        template = ForwardBatch(ForwardMode.DECODE, *(torch.zeros(1, dtype=torch.int64, device=self.device),) * 4,
                                [0], [1], req_to_token, self.kv_pool, self.attn_backend)
        with torch.inference_mode():
            self.graphs.capture(template)
        self.sample_graphs = SampleGraphs(self.graphs.static[ForwardMode.DECODE].logits, self.graphs.sizes)
        with torch.inference_mode():
            prefill_tokens = self.prefill_graph_max_tokens()
            if prefill_tokens:
                self.prefill_graphs = PrefillGraphs(self.model, self.attn_backend, self.vocab_size, prefill_tokens,
                                                    template, self.feature_mode, max_reqs=max_running)

    def prefill_graph_max_tokens(self) -> int:
        """The longest prefill chunk a graph serves: --cuda-graph-max-prefill-tokens, at
        most the chunk size (a longer prefill is chunked first)."""
        n = self.runner_cfg.cuda_graph_max_prefill_tokens
        chunk = self.chunked_prefill_size
        return min(n, chunk) if chunk is not None and chunk > 0 else n

    def graph_max_bs(self, max_running: int) -> int:
        """The largest batch a captured graph serves (--cuda-graph-max-bs, default 256)."""
        return min(self.runner_cfg.cuda_graph_max_bs or 256, max_running)

    def _kv_budget(self, cache_cfg: CacheConfig) -> int:
        cfg = self.model.config
        per_slot = KVPool.bytes_per_slot(cfg.num_layers, cfg.kv_heads_per_rank, cfg.head_dim, self.kv_dtype)
        if cache_cfg.max_total_tokens:
            n = cache_cfg.max_total_tokens
        elif self.device.type == "cuda":
            # A draft's own KV pool has a slot for each of ours: counted in here rather than
            # left to the fixed headroom, which a large pool outgrows
            draft = self._draft_bytes_per_slot()
            n = self._gpu_budget(cache_cfg, per_slot + draft)
        else:
            n = min(CPU_KV_BUDGET_BYTES // per_slot, 4 * self.context_length)
        if n < self.context_length + 1:
            logger.warning("KV budget of %d tokens is below the context length %d: context "
                           "length reduced to %d", n, self.context_length, n - 1)
            self.context_length = n - 1
        # The scheduler's decisions depend on the budget, and every tensor-parallel rank must
        # make the same ones: all take the smallest rank's
        return parallel.min_int(n)

    def _draft_bytes_per_slot(self) -> int:
        """A draft's own KV bytes per target slot; its KV heads (given for the whole model)
        are split over the tensor-parallel ranks as the target's are."""
        if self.draft_kv_shape is None:
            return 0
        layers, kv_heads, head_dim = self.draft_kv_shape
        return KVPool.bytes_per_slot(layers, parallel.kv_heads_per_rank(kv_heads), head_dim, self.kv_dtype)

    def _gpu_budget(self, cache_cfg: CacheConfig, per_slot: int) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        fraction = cache_cfg.mem_fraction_static
        if fraction is None:
            fraction = auto_mem_fraction(total, self.chunked_prefill_size, self.runner_cfg_max_bs,
                                         self.draft_headroom_mb)
        usable = int(total * fraction) - (total - free)  # what the weights left of the fraction
        if usable <= per_slot * 256:
            raise RuntimeError(f"not enough GPU memory for the KV cache after loading weights "
                               f"(--mem-fraction-static {fraction:.3f}): {OOM_ADVICE}")
        return usable // per_slot

    def forward_batch(self, batch: ScheduleBatch, req_to_token: torch.Tensor,
                      kv_pool: KVPool | None = None) -> ForwardBatch:
        """Device tensors for `batch`; `kv_pool` defaults to this runner's (a draft model
        shares the target's table and slots but has a pool of its own)."""
        positions = batch.positions
        if positions is None:
            positions = [p + i for p, n in zip(batch.prefix_lens, batch.extend_lens) for i in range(n)]
        if batch.all_logits:
            logit_rows = torch.arange(batch.num_tokens)
        else:
            ends = torch.tensor(batch.extend_lens).cumsum(0) - 1
            logit_rows = ends[torch.tensor(batch.sample_mask, dtype=torch.bool)]
        rows = batch.rows or [r.row for r in batch.reqs]
        # One host->device copy for every host-side index vector (each copy is a launch);
        # ids and positions may already be device tensors (drafted on the GPU).
        vecs = {"ids": batch.input_ids, "pos": positions, "slots": batch.out_slots, "rows": rows,
                "logit_rows": logit_rows}
        on_dev = {k: v for k, v in vecs.items() if isinstance(v, torch.Tensor) and v.device.type == self.device.type}
        host = [k for k in vecs if k not in on_dev]
        on_dev |= dict(zip(host, h2d_many([vecs[k] for k in host], self.device)))
        ids, pos, slots, req_rows, logit_rows = (_int64(on_dev[k]) for k in vecs)
        return ForwardBatch(
            mode=batch.mode, input_ids=ids, positions=pos, out_slots=slots, req_rows=req_rows,
            prefix_lens=batch.prefix_lens, extend_lens=batch.extend_lens,
            req_to_token=req_to_token, kv_pool=kv_pool or self.kv_pool, attn_backend=self.attn_backend,
            custom_masks=batch.custom_masks, logit_rows=logit_rows,
        )

    def device_verify_batch(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                            rows: torch.Tensor, prefix: torch.Tensor, masks: torch.Tensor,
                            req_to_token: torch.Tensor) -> ForwardBatch:
        """A VERIFY ForwardBatch of B full trees of N nodes straight from device tensors (a
        pipelined step, spec/pipeline.py): ids, positions and slots [B*N], rows and prefix
        lengths [B], masks [B, N, N]. No host list is read or copied; the host-side
        prefix_lens are placeholders (`device_prefix` holds the truth)."""
        b, n = masks.shape[0], masks.shape[1]
        return ForwardBatch(ForwardMode.VERIFY, ids, positions, slots, rows, [0] * b, [n] * b, req_to_token,
                            self.kv_pool, self.attn_backend, custom_masks=masks, logit_rows=self.arange(b * n),
                            device_prefix=prefix)

    def arange(self, n: int) -> torch.Tensor:
        """arange(n) on the device, cached: the logit rows of a forward that wants every
        row (a graph's shape), with no launch per step."""
        rows = self._aranges.get(n)
        if rows is None:
            rows = self._aranges[n] = torch.arange(n, device=self.device)
        return rows

    @property
    def verify_graph_tokens(self) -> int:
        """N when VERIFY graphs are captured (verify batches must then have N nodes per request)."""
        st = self.graphs.static.get(ForwardMode.VERIFY) if self.graphs is not None else None
        return st.tokens if st is not None else 0

    def capture_features(self, mode: str, aux_layers: tuple[int, ...] = ()) -> None:
        """Make forward_with_features return the target's per-token features: "final" (the
        final normed hidden, EAGLE-2 / MTP) or "aux" (residual-stream states captured
        before each of `aux_layers`, concatenated in that order: EAGLE-3)."""
        if mode not in ("final", "aux"):
            raise ValueError(f"unknown feature mode {mode!r}")
        self.feature_mode = mode
        self.model.aux_layers = tuple(aux_layers) if mode == "aux" else ()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: list[Req], lag: list[int] | None = None) -> SampleOutput:
        """The next token of each of `reqs` from its row of `logits` (processed): one
        sampling-graph replay when the rows are a decode graph's (sample_graphs.py), else
        `runner.sampler.sample`. lag: as in `sampling_batch`."""
        graphs, ps = self.sample_graphs, [r.params for r in reqs]
        if graphs is not None and logits.shape[0] == len(reqs) \
                and graphs.covers(logits, all(p.greedy for p in ps), any(p.logprobs for p in ps)):
            return graphs.sample(reqs, lag)
        return sample(logits, sampling_batch(reqs, self.vocab_size, logits.device, lag))

    @torch.inference_mode()
    def forward_with_features(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's logits as `forward`, plus features [T, F] of every new token (None
        unless `capture_features` was called)."""
        graphs = self._graphs_for(fb)
        if graphs is not None:
            return graphs.replay(fb)
        fb.attn_backend.init_forward_metadata(fb)
        return self._logits_and_features(fb, fb.logit_rows)

    def _graphs_for(self, fb: ForwardBatch) -> CudaGraphRunner | PrefillGraphs | None:
        """The captured graphs that can run this target forward, if any."""
        if fb.attn_backend is not self.attn_backend:
            return None
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None and graphs.can_run(fb):
                return graphs
        return None

    def forward_inline(self, fb: ForwardBatch, static_meta: bool, argmax_only: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward_with_features over every row of `fb`, replaying no graph, so a caller's
        CUDA graph can hold it (spec/eagle/step_graphs.py). `static_meta`: the attention metadata
        goes into the backend's graph buffers from device tensors (capturable), else it is
        built from the host lists as an eager forward's. `argmax_only`: the logits are
        only argmaxed (a greedy walk), so they may stay in the model's dtype."""
        (self.attn_backend.init_metadata_for_replay if static_meta else self.attn_backend.init_forward_metadata)(fb)
        return self._logits_and_features(fb, None, float32=not argmax_only)

    def _logits_and_features(self, fb: ForwardBatch, rows: torch.Tensor | None, float32: bool = True
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model over `fb` (metadata ready): logits of `rows` (None: every row) and features."""
        hidden, aux = self.model(fb)
        logits = self.model.compute_logits(hidden if rows is None else hidden[rows], float32)
        if self.feature_mode is None:
            return logits, None
        return logits, hidden if self.feature_mode == "final" else torch.cat(aux, dim=-1)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, model: LlamaForCausalLM | None = None) -> torch.Tensor:
        """Run the model (or a draft model sharing this runner's table); return float32
        logits [len(fb.logit_rows), vocab]."""
        model = model or self.model
        graphs = self._graphs_for(fb) if model is self.model else None
        if graphs is not None:
            return graphs.replay(fb)[0]
        fb.attn_backend.init_forward_metadata(fb)
        hidden, _ = model(fb)
        return model.compute_logits(hidden[fb.logit_rows])


def _int64(t: torch.Tensor) -> torch.Tensor:
    """t as int64, without dispatching a no-op conversion (host time: see core/h2d.py)."""
    return t if t.dtype == torch.int64 else t.to(torch.int64)
