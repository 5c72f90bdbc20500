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
from specserve.config import CacheConfig, ModelConfig, RunnerConfig
from specserve.engine.batch import ScheduleBatch
from specserve.models.llama import LlamaForCausalLM
from specserve.models.loader import load_model, pick_dtype, read_hf_config
from specserve.runner.forward_batch import ForwardBatch

logger = logging.getLogger("specserve")

CPU_KV_BUDGET_BYTES = 2 << 30  # a fixed KV budget on CPU (no memory profiling there)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def make_backend(name: str | None, device: torch.device) -> AttentionBackend:
    if name in (None, "torch"):
        return TorchRefBackend()
    raise ValueError(f"attention backend {name!r} is not available yet (available: torch)")


class ModelRunner:
    def __init__(self, model_dir: Path, model_cfg: ModelConfig, cache_cfg: CacheConfig,
                 runner_cfg: RunnerConfig) -> None:
        self.device = pick_device(model_cfg.device)
        self.model_dir = Path(model_dir)
        hf = read_hf_config(model_dir)
        self.dtype = pick_dtype(model_cfg.dtype, self.device, hf)
        self.model = load_model(model_dir, self.dtype, self.device)
        cfg = self.model.config
        self.vocab_size = cfg.vocab_size
        self.context_length = model_cfg.context_length or cfg.max_position_embeddings
        if self.context_length > cfg.max_position_embeddings:
            raise ValueError(f"--context-length {self.context_length} exceeds the model's "
                             f"max_position_embeddings {cfg.max_position_embeddings}")
        self.num_slots = self._kv_budget(cache_cfg)
        self.kv_pool = KVPool(self.num_slots, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                              self.dtype, self.device)
        self.attn_backend_name = runner_cfg.attention_backend
        self.attn_backend = make_backend(runner_cfg.attention_backend, self.device)
        self.feature_mode: str | None = None  # what forward_with_features returns (EAGLE drafts)
        if self.device.type == "cuda" and not runner_cfg.disable_cuda_graph:
            logger.warning("CUDA graphs are not implemented yet: decoding runs eagerly "
                           "(--cuda-graph-max-bs has no effect)")

    def _kv_budget(self, cache_cfg: CacheConfig) -> int:
        cfg = self.model.config
        per_slot = KVPool.bytes_per_slot(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        if cache_cfg.max_total_tokens:
            n = cache_cfg.max_total_tokens
        elif self.device.type == "cuda":
            n = self._gpu_budget(cache_cfg, per_slot)
        else:
            n = min(CPU_KV_BUDGET_BYTES // per_slot, 4 * self.context_length)
        if n < self.context_length + 1:
            logger.warning("KV budget of %d tokens is below the context length %d: context "
                           "length reduced to %d", n, self.context_length, n - 1)
            self.context_length = n - 1
        return n

    def _gpu_budget(self, cache_cfg: CacheConfig, per_slot: int) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        fraction = cache_cfg.mem_fraction_static
        if fraction is None:  # leave room for activations, graphs and a draft model
            reserve = max(2 << 30, int(0.1 * total))
            usable = free - reserve
        else:
            used = total - free
            usable = int(total * fraction) - used
        if usable <= per_slot * 256:
            raise RuntimeError(
                "not enough GPU memory for the KV cache after loading weights: lower "
                "--mem-fraction-static's headroom, use --max-total-tokens, a smaller "
                "--cuda-graph-max-bs or --max-running-requests (see the OOM section of the docs)")
        return usable // per_slot

    def forward_batch(self, batch: ScheduleBatch, req_to_token: torch.Tensor,
                      kv_pool: KVPool | None = None) -> ForwardBatch:
        """Device tensors for `batch`; `kv_pool` defaults to this runner's (a draft model
        shares the target's table and slots but has a pool of its own)."""
        dev = self.device
        positions = batch.positions
        if positions is None:
            positions = [p + i for p, n in zip(batch.prefix_lens, batch.extend_lens) for i in range(n)]
        if batch.all_logits:
            logit_rows = torch.arange(batch.num_tokens)
        else:
            ends = torch.tensor(batch.extend_lens).cumsum(0) - 1
            logit_rows = ends[torch.tensor(batch.sample_mask, dtype=torch.bool)]
        return ForwardBatch(
            mode=batch.mode,
            input_ids=torch.tensor(batch.input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            out_slots=batch.out_slots.to(dev, non_blocking=True),
            req_rows=torch.tensor(batch.rows or [r.row for r in batch.reqs], dtype=torch.int64, device=dev),
            prefix_lens=batch.prefix_lens, extend_lens=batch.extend_lens,
            req_to_token=req_to_token, kv_pool=kv_pool or self.kv_pool, attn_backend=self.attn_backend,
            custom_masks=batch.custom_masks, logit_rows=logit_rows.to(dev),
        )

    def capture_features(self, mode: str, aux_layers: tuple[int, ...] = ()) -> None:
        """Make forward_with_features return the target's per-token features: "final" (the
        final normed hidden, EAGLE-2 / MTP) or "aux" (residual-stream states captured
        before each of `aux_layers`, concatenated in that order: EAGLE-3)."""
        if mode not in ("final", "aux"):
            raise ValueError(f"unknown feature mode {mode!r}")
        self.feature_mode = mode
        self.model.aux_layers = tuple(aux_layers) if mode == "aux" else ()

    @torch.inference_mode()
    def forward_with_features(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's logits as `forward`, plus features [T, F] of every new token (None
        unless `capture_features` was called)."""
        fb.attn_backend.init_forward_metadata(fb)
        hidden, aux = self.model(fb)
        logits = self.model.compute_logits(hidden[fb.logit_rows])
        if self.feature_mode is None:
            return logits, None
        return logits, hidden if self.feature_mode == "final" else torch.cat(aux, dim=-1)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, model: LlamaForCausalLM | None = None) -> torch.Tensor:
        """Run the model (or a draft model sharing this runner's table); return float32
        logits [len(fb.logit_rows), vocab]."""
        model = model or self.model
        fb.attn_backend.init_forward_metadata(fb)
        hidden, _ = model(fb)
        return model.compute_logits(hidden[fb.logit_rows])
