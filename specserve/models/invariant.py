"""`--enable-deterministic-inference` on a model: every row computed one way, whatever the batch.

Invariant: the logits of a token, and every K/V it leaves in the cache, are the same bits
whether it is decoded alone, verified as a node of a draft tree, computed in a prefill
chunk, or batched with any other requests. Greedy speculative decoding then equals plain
decoding bit for bit in bf16 (exact arithmetic alone made it equal in fp32), and a
request's output never depends on its neighbours.

What `LlamaForCausalLM.make_invariant` changes on a target (drafts are left as they are:
they only propose, and exact verification makes the output the target's):
  * every linear layer and the LM head run one kernel whose row arithmetic is fixed by the
    weight alone (`kernels/invariant_mm.py`), never cuBLAS (its kernel follows M) nor the
    few-token GEMVs (their tiles follow the token count): `Linear.invariant`, and
    `LlamaForCausalLM` leaves its few-token path; the logits come out in fp32 from the
    kernel's accumulator on every path (no rounding to the model's dtype first);
  * on the GPU the norms, SiLU*mul and the residual adds ride on those kernels'
    epilogues (`forward_layers`): a layer is qkv (x normalised: the input norm's weight
    folded into the weight at start-up, `fold_norms`, and 1/rms applied to the
    accumulator), RoPE + KV write, attention, o_proj (+ residual, and the stream's partial
    sums of squares the next norm reads), gate_up (normalised likewise; silu(gate) * up
    from its epilogue), down_proj (+ residual); the stream is one tensor between layers, as in the
    few-token path. Layers with q/k norms (Qwen3) keep separate row-local launches for
    norms, SiLU*mul and adds (`LlamaForCausalLM.forward_eager`); either way every forward
    of a model takes the same path;
  * attention walks each query's keys in position order with splits fixed by its own
    length (`attention/triton_invariant.py`, chosen by the runner's `make_backend`);
  * on a GPU, quantized layers with half activations take the mode's kernels too
    (`quantized_on_gpu`): fp8 weights kernels/invariant_mm.py (their tiles widened exactly,
    the scales applied to the fp32 sums); a GGUF's blocks and AWQ/GPTQ weights held as q4
    kernels/blocks_x16.py's int16 products at every row count, the head too
    (each row rounded to int16 alone, integer sums in an order fixed by the weight), where
    the fast path changes kernels with the token count. Their norms and SiLU*mul stay
    separate row-local launches (nothing is folded into quantized weights).
On a CPU (no Triton), the same contract in torch (`layers.invariant_linear`, `RMSNorm`, the
MLP's SiLU, the reference attention): products, sums, norms and SiLU in float64, rounded
once to the model's dtype; a GGUF's layers (and head) held in blocks keep the CPU's block
kernels, which compute each row alone in a fixed order (`row_local_blocks`), layer by layer
(the one-call C stack does not serve the float64 attention). CPU libraries pick their
summation order from the shape, but in float64 every order lands within ~1e-13 (relative) of
the exact value, so rounding to bf16 (a step of 2^-8) comes out the same unless the exact
value sits that close to a rounding boundary. Exact by construction on the GPU; on the CPU,
by that margin.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from specserve import kernels
from specserve.core import quant
from specserve.kernels import cpu_quant
from specserve.models.layers import Linear, RMSNorm, activation_dtype

if TYPE_CHECKING:
    from collections.abc import Iterable

    from specserve.core.forward_batch import ForwardBatch
    from specserve.core.rope import RopeAt
    from specserve.models.llama import DecoderLayer, LlamaForCausalLM


def row_local_blocks(qw: quant.QuantWeight | None) -> bool:
    """Whether `qw` is a GGUF's blocks that the CPU's kernels multiply (kernels/cpu_quant.py):
    each row's product there is computed alone, in an order fixed by the weight (inputs
    rounded to int16 per 32 columns, integer sums, one scale a group), whatever the row
    count, the batch or the threads: the invariant contract as it is."""
    return (qw is not None and qw.method in (quant.Q4, quant.Q8) and not qw.data.is_cuda
            and cpu_quant.available() and cpu_quant.servable(qw))


def quantized_on_gpu(qw: quant.QuantWeight | None, dtype: torch.dtype) -> bool:
    """Whether `qw` is a quantized weight on a GPU that the mode's kernels multiply with
    activations of `dtype` (half): fp8 (`kernels.invariant_matmul`: its tiles widened
    exactly, the scales applied to the fp32 sums) or blocks
    (`kernels.invariant_blocks`: each row rounded to int16 alone and summed in integers in
    an order fixed by the weight). Either way whatever the row count."""
    return qw is not None and kernels.invariant_quantized_serve(qw, dtype)


def enable_layers(model: nn.Module) -> None:
    """Put every `Linear` and `RMSNorm` of `model` on the invariant path (a causal LM's
    head and few-token path: `LlamaForCausalLM.make_invariant`). A GGUF's blocks on the CPU
    (`row_local_blocks`) keep their kernels; on a GPU, fp8 weights and blocks (AWQ/GPTQ's
    held as q4 too) take the mode's own (`quantized_on_gpu`); others are refused."""
    dtype = activation_dtype(model)
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            if row_local_blocks(module.quantized):
                continue
            if module.quantized is not None and not quantized_on_gpu(module.quantized, dtype):
                raise ValueError(f"--enable-deterministic-inference does not cover these quantized layers ({name}: "
                                 f"{module.quantized.method}, {str(dtype).removeprefix('torch.')} activations)")
            module.invariant = True
            if module.weight_t is not None:  # the CPU's layout: keep the float64 copy it multiplies by
                module.weight64 = module.weight_t.detach().double()
        elif isinstance(module, RMSNorm):
            module.invariant = True


def fold_norms(model: LlamaForCausalLM) -> bool:
    """Fold each layer's norm weights into the projections after them (qkv: the input
    norm's, gate_up: the post-attention norm's; W diag(w), rounded once to the weight's
    dtype) when `forward_layers` will serve the model: pre-norm layers without q/k norms
    (Qwen3 has them) whose weights the fused kernels take. Returns whether it folded; a folded
    model runs `forward_layers` only."""
    layers = cast("list[DecoderLayer]", list(model.model.layers))
    if not layers or layers[0].self_attn.qkv_proj.quantized is not None:  # a GGUF's blocks: on the CPU
        return False
    if not kernels.use_fused(_weight(layers[0].self_attn.qkv_proj)):
        return False
    if not all(isinstance(layer.input_layernorm, RMSNorm) and layer.self_attn.q_norm is None for layer in layers):
        return False
    with torch.no_grad():
        for layer in layers:
            for proj, norm in ((layer.self_attn.qkv_proj, layer.input_layernorm),
                               (layer.mlp.gate_up_proj, layer.post_attention_layernorm)):
                assert isinstance(norm, RMSNorm)  # checked above
                weight = _weight(proj)
                weight.copy_(weight.float() * norm.weight.float())
    return True


def forward_layers(model: LlamaForCausalLM, h: torch.Tensor, fb: ForwardBatch,
                   rope: RopeAt) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The stream h [T, hidden] through every (folded) layer on the invariant kernels with
    norms, SiLU*mul and residual adds in their epilogues (module docstring), then the final
    norm: (normed hidden, the aux states `model.aux_layers` asks for: the stream itself)."""
    if not (kernels.use_fused(h) and fb.attn_backend.pooled_kv):
        raise RuntimeError("a model with folded norms runs on the fused kernels and a pooled KV cache only")
    captured: dict[int, torch.Tensor] = {}
    sumsq = kernels.row_sumsq(h)
    for i, layer in enumerate(cast("Iterable[DecoderLayer]", model.model.layers)):
        if i in model.aux_layers:
            captured[i] = h
        h, sumsq = _layer(layer, h, sumsq, fb, rope)
    captured[model.config.num_layers] = h
    return model.model.norm(h), [captured[i] for i in model.aux_layers]


def _layer(layer: DecoderLayer, h: torch.Tensor, sumsq: torch.Tensor, fb: ForwardBatch,
           rope: RopeAt) -> tuple[torch.Tensor, torch.Tensor]:
    attn, mlp, pool = layer.self_attn, layer.mlp, fb.kv_pool
    eps = cast(RMSNorm, layer.input_layernorm).eps
    qkv = kernels.invariant_matmul(h, _weight(attn.qkv_proj), attn.qkv_proj.bias, norm=(eps, sumsq))
    q = kernels.rope_store_kv(qkv.view(-1, attn.heads + 2 * attn.kv_heads, attn.head_dim), attn.heads,
                              *rope.tables(), pool.k[attn.layer_id], pool.v[attn.layer_id], fb.out_slots,
                              k_scale=pool.k_scale, v_scale=pool.v_scale)
    out = fb.attn_backend.forward(q, None, None, attn.layer_id, fb, attn.scale).reshape(h.shape[0], -1)
    h, sumsq = kernels.invariant_matmul(out, _weight(attn.o_proj), residual=h, sumsq=True)
    eps = layer.post_attention_layernorm.eps
    act = kernels.invariant_matmul(h, _weight(mlp.gate_up_proj), norm=(eps, sumsq), gated=True)
    return kernels.invariant_matmul(act, _weight(mlp.down_proj), residual=h, sumsq=True)


def _weight(proj: Linear) -> torch.Tensor:
    """A projection's float weight [out, in] (the mode refuses quantized layers: `enable_layers`)."""
    weight = proj.out_in_weight
    assert isinstance(weight, torch.Tensor), "invariant layers are not quantized"
    return weight
