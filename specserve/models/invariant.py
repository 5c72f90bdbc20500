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
  * norms, RoPE, SiLU*mul and the residual adds are row-local already (one program per
    row, or elementwise); on the GPU the layers run at any token count much as the
    few-token path runs a few (`forward_layers`: SiLU*mul and the residual adds inside
    the products), on the CPU as written;
  * attention walks each query's keys in position order with splits fixed by its own
    length (`attention/triton_invariant.py`, chosen by the runner's `make_backend`).
On a CPU (no Triton), the same contract in torch (`layers.invariant_linear`, `RMSNorm`,
the MLP's SiLU, the reference attention): products, sums, norms and SiLU in float64,
rounded once to the model's dtype. CPU libraries pick their summation order from the
shape, but in float64 every order lands within ~1e-13 (relative) of the exact value, so
rounding to bf16 (a step of 2^-8) comes out the same unless the exact value sits that
close to a rounding boundary. Exact by construction on the GPU; on the CPU, by that margin.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from specserve import kernels
from specserve.core.forward_batch import ForwardBatch
from specserve.models.layers import Linear, RMSNorm

if TYPE_CHECKING:
    from specserve.core.rope import RopeAt
    from specserve.models.llama import DecoderLayer, LlamaForCausalLM


def enable_layers(model: nn.Module) -> None:
    """Put every `Linear` and `RMSNorm` of `model` on the invariant path (a causal LM's
    head and few-token path: `LlamaForCausalLM.make_invariant`). Quantized layers are
    refused (their kernels are not covered)."""
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            if module.quantized is not None:
                raise ValueError(f"--enable-deterministic-inference does not cover quantized layers ({name})")
            module.invariant = True
            if module.weight_t is not None:  # the CPU's layout: keep the float64 copy it multiplies by
                module.weight64 = module.weight_t.detach().double()
        elif isinstance(module, RMSNorm):
            module.invariant = True


def fused_ready(model: LlamaForCausalLM, h: torch.Tensor, fb: ForwardBatch) -> bool:
    """Whether `forward_layers` can run this forward: the Triton kernels, a pooled KV
    cache, and layers of the few-token shape (no q/k norms, no q/k/v bias)."""
    return (kernels.use_fused(h) and fb.attn_backend.pooled_kv and len(model.model.layers) > 0
            and all(layer.few_tokens_ready for layer in model.model.layers))


def forward_layers(model: LlamaForCausalLM, h: torch.Tensor, fb: ForwardBatch,
                   rope: RopeAt) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The invariant model's layers over any number of tokens as the few-token path runs
    a few (`LlamaForCausalLM._forward_few_tokens`): the stream [T, hidden] is one tensor,
    SiLU*mul rides on gate_up's product, each residual add on o_proj's and down_proj's
    (kernels/invariant_mm.py); the pre-norms are launches of their own. Returns the final
    normed hidden and the aux states (the stream before each aux layer; after the last)."""
    captured: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(cast("Iterable[DecoderLayer]", model.model.layers)):  # ModuleList is untyped
        if i in model.aux_layers:
            captured[i] = h
        h = _layer(layer, h, fb, rope)
    captured[model.config.num_layers] = h
    return model.model.norm(h), [captured[i] for i in model.aux_layers]


def _layer(layer: DecoderLayer, stream: torch.Tensor, fb: ForwardBatch, rope: RopeAt) -> torch.Tensor:
    """One decoder layer, stream in and out: two norms, four products, RoPE + KV write, attention."""
    from specserve.kernels.invariant_mm import invariant_matmul

    attn, mlp, pool = layer.self_attn, layer.mlp, fb.kv_pool
    norm, post = cast(RMSNorm, layer.input_layernorm), layer.post_attention_layernorm
    qkv = invariant_matmul(norm(stream), _weight(attn.qkv_proj))
    q = kernels.rope_store_kv(qkv.view(-1, attn.heads + 2 * attn.kv_heads, attn.head_dim), attn.heads,
                              *rope.tables(), pool.k[attn.layer_id], pool.v[attn.layer_id], fb.out_slots,
                              k_scale=pool.k_scale, v_scale=pool.v_scale)
    out = fb.attn_backend.forward(q, None, None, attn.layer_id, fb, attn.scale)
    stream = invariant_matmul(out.reshape(stream.shape[0], -1), _weight(attn.o_proj), residual=stream)
    act = invariant_matmul(post(stream), _weight(mlp.gate_up_proj), gated=True)
    return invariant_matmul(act, _weight(mlp.down_proj), residual=stream)


def _weight(linear: Linear) -> torch.Tensor:
    weight = linear.out_in_weight
    assert isinstance(weight, torch.Tensor), "invariant layers are not quantized"
    return weight
