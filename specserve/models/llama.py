"""One model file for the Llama family: Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3, SmolLM2, MiMo.

The differences are config switches: q/k/v bias (Qwen2, MiMo), per-head q/k RMSNorm (Qwen3),
tied embeddings (SmolLM2, small Qwens), RoPE scaling (Llama 3.1). The model knows
nothing about serving: it takes a ForwardBatch and returns final hidden states; the
attention backend named by the batch does the attention. It can also return the
residual stream at chosen layers (EAGLE-3's auxiliary hidden states).

The residual stream is carried as a pair (h, residual) whose sum is the stream: each
residual add is deferred into the following norm (`RMSNorm.forward_add`), which on CUDA
is one fused Triton launch (`specserve.kernels`); the final norm takes the last add. On
CPU the same adds run in torch, in the same order, so results are unchanged. A forward
of up to 32 tokens on CUDA (unless SPECSERVE_SKINNY=0: one) instead carries the stream as
one tensor: the norms, SiLU*mul and residual adds ride on the linear layers' GEMVs
(`kernels/matvec.py`, `kernels/skinny.py`), where each op rounds as its torch op does.

MTP layers stored in a trunk's checkpoint (DeepSeek-style `model.layers.{L + i}.*` when
`num_nextn_predict_layers` > 0, MiMo's `model.mtp_layers.*`) belong to the draft model
(`mtp.py`): the trunk skips them. Checkpoint tensors land in the fused projections
through `checkpoint.py`, shared with the draft loaders.

Under tensor parallelism (core/parallel.py) each layer is built with this rank's share:
q/k/v and gate/up column-parallel, o_proj and down_proj row-parallel with one all-reduce
after each, the embedding and LM head vocab-parallel (logits gathered to every rank).
"""
from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from specserve import kernels
from specserve.core import parallel
from specserve.core.forward_batch import ForwardBatch
from specserve.core.quant import QuantWeight
from specserve.core.rope import RopeAt
from specserve.models import invariant
from specserve.models.checkpoint import check_complete, load_tensor, loadable_tensors
from specserve.models.compile import CompiledForward
from specserve.models.compile import attention as compiled_attention
from specserve.models.cpu_stack import CpuStack
from specserve.models.layers import (
    Embedding,
    Linear,
    RMSNorm,
    activation_dtype,
    cpu_layout,
    gpu_layout,
    invariant_linear,
)
from specserve.models.quant_linear import quant_linear
from specserve.models.rope import RotaryEmbedding, apply_rope

if TYPE_CHECKING:
    from specserve.models.quantization import WeightQuant

logger = logging.getLogger("specserve")

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "MiMoForCausalLM")
_QKV_BIAS_BY_DEFAULT = ("Qwen2ForCausalLM", "MiMoForCausalLM")  # MiMo is a Qwen2 trunk


@dataclass(frozen=True)
class LlamaConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    num_nextn_predict_layers: int = 0  # DeepSeek-style MTP layers stored after the trunk's
    # An fp8 checkpoint's scale blocks (rows, columns): quantization_config.weight_block_size
    weight_block: tuple[int, int] | None = None

    @classmethod
    def from_hf(cls, d: dict) -> LlamaConfig:
        arch = (d.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"architecture {arch} is not supported (supported: {', '.join(ARCHITECTURES)})")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (only silu)")
        heads = d["num_attention_heads"]
        theta, scaling = _rope_params(d)
        return cls(
            architecture=arch, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
            num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=_max_positions(d),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", arch in _QKV_BIAS_BY_DEFAULT),
            qk_norm=arch == "Qwen3ForCausalLM",
            num_nextn_predict_layers=d.get("num_nextn_predict_layers") or 0,
            weight_block=_weight_block(d),
        )

    @property
    def heads_per_rank(self) -> int:
        """Query heads on this tensor-parallel rank (core/parallel.py `head_shard`)."""
        return parallel.head_shard(self.num_heads, self.num_kv_heads)[1]

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads on this rank: what its KV pool holds."""
        return parallel.kv_heads_per_rank(self.num_kv_heads)

    @property
    def intermediate_per_rank(self) -> int:
        return parallel.split(self.intermediate_size, "the MLP's intermediate size")


def _rope_params(d: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from transformers 4 (`rope_theta`, `rope_scaling`) or 5 (`rope_parameters`)."""
    params = d.get("rope_parameters") or {}
    theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


def _weight_block(d: dict) -> tuple[int, int] | None:
    block = (d.get("quantization_config") or {}).get("weight_block_size")
    return (int(block[0]), int(block[1])) if block else None


def _max_positions(d: dict) -> int:
    """Sliding-window attention is not implemented: cap the context at the window instead."""
    n = d.get("max_position_embeddings", 4096)
    window = d.get("sliding_window")
    uses_window = d.get("use_sliding_window", d.get("model_type") == "mistral")
    if window and uses_window and window < n:
        logger.warning("sliding-window attention is not supported: context capped at %d", window)
        n = window
    return n


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int, in_features: int | None = None) -> None:
        """`in_features` defaults to hidden_size (EAGLE-3's midlayer feeds 2 * hidden_size)."""
        super().__init__()
        self.layer_id = layer_id
        self.heads, self.kv_heads, self.head_dim = cfg.heads_per_rank, cfg.kv_heads_per_rank, cfg.head_dim
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = Linear(in_features or cfg.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, fb: ForwardBatch, rope: RopeAt) -> torch.Tensor:
        h, kv = self.heads, self.kv_heads
        qkv = self.qkv_proj(x).view(-1, h + 2 * kv, self.head_dim)  # [T, H + 2 kvH, D]
        if self.q_norm is None and kernels.use_fused(qkv) and fb.attn_backend.pooled_kv:
            # one launch: RoPE, and the keys and values written into this layer's cache
            pool = fb.kv_pool
            caches = pool.k[self.layer_id], pool.v[self.layer_id], fb.out_slots
            q = kernels.rope_store_kv(qkv, h, *rope.tables(), *caches, k_scale=pool.k_scale, v_scale=pool.v_scale)
            return parallel.all_reduce(self.o_proj(fb.attn_backend.forward(q, None, None, self.layer_id, fb,
                                                                           self.scale)))
        qk, v = qkv[:, :h + kv], qkv[:, h + kv:]
        if self.q_norm is not None:
            assert self.k_norm is not None  # q_norm and k_norm exist together (cfg.qk_norm)
            qk = torch.cat([self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])], dim=1)
        qk = apply_rope(qk, *rope.tables())  # queries and keys rotated together
        q, k = qk[:, :h], qk[:, h:]
        if torch.compiler.is_compiling():  # opaque to inductor: the backend behind a custom op
            return self.o_proj(compiled_attention(q, k, v, self.layer_id, self.scale))
        return parallel.all_reduce(self.o_proj(fb.attn_backend.forward(q, k, v, self.layer_id, fb, self.scale)))

    @property
    def few_tokens_ready(self) -> bool:
        """Whether `forward_few_tokens` can run: no q/k norms (a q/k/v bias is fine)."""
        return self.q_norm is None

    def forward_few_tokens(self, stream: torch.Tensor, norm: RMSNorm | None, fb: ForwardBatch,
                           rope: RopeAt,
                           residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + o_proj(attention(norm(stream))) for a few tokens [T, in_features]
        (residual: the stream itself unless given; norm None: none): the norm rides on the
        qkv GEMV and the residual add on o_proj's (kernels/matvec.py, kernels/skinny.py), and
        for 2 or more tokens RoPE and the KV write too (kernels/qkv_rope.py); needs a pooled
        KV cache. Under tensor parallelism rank 0 alone adds the residual, and the all-reduce
        after o_proj sums it once with every rank's share. A q/k/v bias (Qwen2) rides on the
        qkv GEMV as its residual add, broadcast over the tokens (each rank adds its shard's);
        RoPE and the KV write then take their own launch at any token count."""
        h, kv, pool = self.heads, self.kv_heads, fb.kv_pool
        norm_weight, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
        caches = pool.k[self.layer_id], pool.v[self.layer_id], fb.out_slots
        scales = pool.k_scale, pool.v_scale  # an fp8 cache's (cache/kv_pool.py)
        bias = self.qkv_proj.bias
        q = None if bias is not None else kernels.qkv_rope_store(
            stream, self.qkv_proj.out_in_weight, h, rope, *caches, norm_weight=norm_weight, eps=eps,
            k_scale=scales[0], v_scale=scales[1])
        if q is None:  # one token, an odd head dim or a bias: the GEMV, then RoPE and the KV write
            qkv = kernels.gemv(stream, self.qkv_proj.out_in_weight, norm_weight=norm_weight, eps=eps,
                               residual=None if bias is None else bias.expand(stream.shape[0], -1))
            q = kernels.rope_store_kv(qkv.view(-1, h + 2 * kv, self.head_dim), h, *rope.tables(), *caches,
                                      k_scale=scales[0], v_scale=scales[1])
        out = fb.attn_backend.forward(q, None, None, self.layer_id, fb, self.scale)
        residual = _rank0_residual(stream if residual is None else residual)
        return parallel.all_reduce(kernels.gemv(out.reshape(stream.shape[0], -1), self.o_proj.out_in_weight,
                                                residual=residual))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        inter = cfg.intermediate_per_rank
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if kernels.use_fused(gate_up):
            return parallel.all_reduce(self.down_proj(kernels.silu_and_mul(gate_up)))
        gate, up = gate_up.chunk(2, dim=-1)
        if self.gate_up_proj.invariant:  # the CPU's invariant path: SiLU in float64, rounded once
            return parallel.all_reduce(self.down_proj(F.silu(gate.double()).to(gate.dtype) * up))
        return parallel.all_reduce(self.down_proj(F.silu(gate) * up))

    def forward_few_tokens(self, stream: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """stream [T, hidden] + mlp(norm(stream)) in two GEMVs (the norm and SiLU*mul ride on
        gate_up's, the residual add on down_proj's)."""
        act = kernels.gemv(stream, self.gate_up_proj.out_in_weight, norm_weight=norm.weight, eps=norm.eps,
                           gated=True)
        return parallel.all_reduce(kernels.gemv(act, self.down_proj.out_in_weight,
                                                residual=_rank0_residual(stream)))


def _rank0_residual(stream: torch.Tensor) -> torch.Tensor | None:
    """The residual a row-parallel GEMV adds: all of it on rank 0, none elsewhere (the
    all-reduce after it adds it once)."""
    return stream if parallel.tp_rank() == 0 else None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int, input_norm: bool = True) -> None:
        """input_norm=False: no input_layernorm (identity), as in EAGLE-1/2's first draft layer."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else nn.Identity()
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, rope: RopeAt) -> torch.Tensor:
        """Stream in, stream out: x + attn + mlp (the interface the draft models use)."""
        h, residual = self.step(x, None, fb, rope)
        return residual + h

    def step(self, h: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch,
             rope: RopeAt) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream entering is h + residual (just h when residual is None); returns
        (mlp output, residual) whose sum is the stream leaving. Both adds are left to
        the next norm, which fuses them on CUDA."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        elif isinstance(self.input_layernorm, RMSNorm):
            x, residual = self.input_layernorm.forward_add(h, residual)
        else:  # no input norm (EAGLE-1/2 layer 0)
            residual = x = residual + h
        x, residual = self.post_attention_layernorm.forward_add(self.self_attn(x, fb, rope), residual)
        return self.mlp(x), residual

    @property
    def few_tokens_ready(self) -> bool:
        return isinstance(self.input_layernorm, RMSNorm) and self.self_attn.few_tokens_ready

    def step_few_tokens(self, stream: torch.Tensor, fb: ForwardBatch,
                        rope: RopeAt) -> torch.Tensor:
        """The stream [T, hidden] in and out (a few tokens) as one residual tensor, no
        deferred adds: five launches besides the attention kernel (kernels/matvec.py)."""
        norm = self.input_layernorm
        assert isinstance(norm, RMSNorm)  # callers check few_tokens_ready first
        stream = self.self_attn.forward_few_tokens(stream, norm, fb, rope)
        return self.mlp.forward_few_tokens(stream, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, parallel.vocab_per_rank(cfg.vocab_size), bias=False)
        # Residual stream captured *before* these layers; num_layers means after the last
        # layer (pre-norm).
        self.aux_layers: tuple[int, ...] = ()
        self.compiled: CompiledForward | None = None  # --enable-torch-compile (models/compile.py)
        self.weight_quant: WeightQuant | None = None  # how the loader quantized it (models/quantization.py)
        # --enable-deterministic-inference (models/invariant.py): the head's rows one way on any
        # batch; on a CPU, multiplied by this float64 [hidden, vocab] copy
        self.invariant = False
        self.folded_norms = False  # invariant, the norms folded into the projections: `invariant.forward_layers`
        self.head_blocks: QuantWeight | None = None  # the LM head as a GGUF's blocks (models/gguf_serve.py)
        self.cpu_stack: CpuStack | None = None  # the layers in one C call on a CPU (models/cpu_stack.py)
        self.head64: torch.Tensor | None = None

    def forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final normed hidden [T, hidden] and the aux hidden states [T, hidden] asked for,
        in the order of `self.aux_layers`; compiled where `self.compiled` serves the batch."""
        if self.compiled is not None and self.compiled.serves(fb):
            return self.compiled(fb)
        return self.forward_eager(fb)

    def forward_eager(self, fb: ForwardBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward` as written (what torch.compile traces)."""
        h = self.model.embed_tokens(fb.input_ids)
        if self.cpu_stack is not None and self.cpu_stack.serves(fb, h):
            return self.cpu_stack(h, fb, self.aux_layers)  # the final norm applied in the same call
        rope = self.model.rotary.at(fb.positions)
        if self._few_tokens(h, fb):
            return self._forward_few_tokens(h, fb, rope)
        if self.folded_norms:  # --enable-deterministic-inference on the GPU (models/invariant.py)
            return invariant.forward_layers(self, h, fb, rope)
        captured: dict[int, torch.Tensor] = {}
        residual: torch.Tensor | None = None  # the stream is h + residual (see the module docstring)
        for i, layer in enumerate(cast("Iterable[DecoderLayer]", self.model.layers)):  # ModuleList is untyped
            if i in self.aux_layers:  # one extra add per aux layer; the fused norm keeps no copy
                captured[i] = h if residual is None else residual + h
            h, residual = layer.step(h, residual, fb, rope)
        if residual is None:  # no layers
            h, residual = self.model.norm(h), h
        else:
            h, residual = self.model.norm.forward_add(h, residual)
        if self.config.num_layers in self.aux_layers:
            captured[self.config.num_layers] = residual
        return h, [captured[i] for i in self.aux_layers]

    def _few_tokens(self, h: torch.Tensor, fb: ForwardBatch) -> bool:
        """Whether this forward takes the few-token GEMV path (`kernels.use_gemv`: up to 32
        tokens), a pooled KV cache, and layers it supports."""
        return (not self.invariant and kernels.use_gemv(h) and fb.attn_backend.pooled_kv and len(self.model.layers) > 0
                and all(layer.few_tokens_ready for layer in self.model.layers))

    def _forward_few_tokens(self, h: torch.Tensor, fb: ForwardBatch,
                            rope: RopeAt) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward` for a few tokens: the stream is one tensor, each residual add fused into
        the GEMV before it, so the captured aux states are the stream itself."""
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(cast("Iterable[DecoderLayer]", self.model.layers)):  # ModuleList is untyped
            if i in self.aux_layers:
                captured[i] = h
            h = layer.step_few_tokens(h, fb, rope)
        captured[self.config.num_layers] = h
        return self.model.norm(h), [captured[i] for i in self.aux_layers]

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Logits of `hidden` [T, H]: float32, or (float32 False, for an argmax alone) maybe
        in the model's dtype, whose conversion would change no argmax (it is exact and
        keeps order) and at a verify of 2048 tokens would read and write some 600 MB a step.
        Invariant (models/invariant.py): float32 always, straight from the accumulator."""
        if self.head_blocks is not None and (not self.invariant or invariant.row_local_blocks(self.head_blocks)):
            return parallel.gather_vocab(quant_linear(hidden, self.head_blocks).float())  # models/gguf_serve.py
        if self.invariant and self.head_blocks is not None:  # on a GPU (`make_invariant` checked the form)
            return parallel.gather_vocab(invariant_linear(hidden, self.head_blocks, None, None, torch.float32))
        if self.invariant:
            return invariant_linear(hidden, self.lm_head.weight, self.head64, None, torch.float32)
        if kernels.use_gemv(hidden, lm_head=True):  # the float32 logits of the half ones, in the GEMV's launch
            return parallel.gather_vocab(kernels.gemv(hidden, self.lm_head.weight, out_dtype=torch.float32))
        logits = parallel.gather_vocab(self.lm_head(hidden))
        return logits.float() if float32 else logits

    def make_invariant(self) -> None:
        """--enable-deterministic-inference (models/invariant.py): every layer, the head
        and the forward's path one way for any batch."""
        invariant.enable_layers(self)
        head = self.head_blocks
        if head is not None and head.data.is_cuda and not invariant.quantized_on_gpu(head, activation_dtype(self)):
            raise ValueError(f"--enable-deterministic-inference does not cover this LM head ({head.method})")
        self.invariant = True
        self.folded_norms = invariant.fold_norms(self)
        if not self.lm_head.weight.is_cuda and not invariant.row_local_blocks(self.head_blocks):
            self.head64 = self.lm_head.weight.detach().t().double().contiguous()

    def finalize(self, device: torch.device, dtype: torch.dtype) -> None:
        """After weights are loaded: tie the head if asked and build RoPE tables."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if device.type == "cpu":
            cpu_layout(self, dtype)
            self.cpu_stack = CpuStack.build(self)  # where every projection holds blocks (AWQ/GPTQ's as q4)
        else:
            gpu_layout(self)
        self.model.rotary.build(device, torch.float32 if dtype == torch.float32 else dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantWeight]],
                     held: Collection[str] = frozenset()) -> None:
        """Load HF-named tensors, stacking q/k/v and gate/up into the fused projections (an
        AWQ/GPTQ layer comes converted whole: models/quantization.py `checkpoint_tensors`).
        `held`: our weights that come in another form (a GGUF's blocks) and are not expected."""
        params = loadable_tensors(self)
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or self._is_mtp_tensor(name):
                continue
            keys = load_tensor(params, self.config, name, tensor)
            if not keys:
                if self.config.tie_word_embeddings and name == "lm_head.weight":
                    continue
                raise ValueError(f"unexpected tensor {name} in checkpoint")
            loaded.update(keys)
        skip = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        check_complete(self, self.config, loaded, skip | set(held))

    def _is_mtp_tensor(self, name: str) -> bool:
        """The draft's tensors stored in the trunk's checkpoint (see the module docstring)."""
        if name.startswith("model.mtp_layers."):
            return True
        if self.config.num_nextn_predict_layers and name.startswith("model.layers."):
            return int(name.split(".")[2]) >= self.config.num_layers
        return False
