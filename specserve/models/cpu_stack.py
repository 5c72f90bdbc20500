"""A Llama-family model held in GGUF blocks runs its decoder layers on the CPU in one C
call a forward (kernels/cpu_layers.py) instead of some twenty torch ops a layer.

`build` is called by models/gguf_serve.py once the blocks are in place; it returns None
unless every layer can go (every projection in blocks the C stack reads; no per-head
q/k norms; float32). `serves` then takes a forward of up to MAX_TOKENS tokens whose
attention metadata is the reference backend's (attention/torch_ref.py) over a float32
KV cache; anything else (long prefill chunks, where torch's SDPA and BLAS-sized work
win) runs the model's torch path, whose products still read the blocks
(models/quant_linear.py). The final norm and the head stay with the model.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch

from specserve.attention.torch_ref import RefMeta, TorchRefBackend
from specserve.core.forward_batch import ForwardBatch
from specserve.kernels import cpu_layers
from specserve.models.layers import RMSNorm

if TYPE_CHECKING:
    from specserve.models.llama import DecoderLayer, LlamaForCausalLM

MAX_TOKENS = 64  # a verify's tree, a decode batch; longer prefill chunks take the torch path


class CpuStack:
    def __init__(self, stack: cpu_layers.Stack, model: LlamaForCausalLM) -> None:
        self.stack = stack
        self.rope = model.model.rotary

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> CpuStack | None:
        weights = []
        layers = list(cast("Iterable[DecoderLayer]", model.model.layers))  # ModuleList is untyped
        for layer in layers:
            attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
            found = [p.quantized for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            projections = [p for p in found if p is not None and cpu_layers.servable(p)]
            if attn.q_norm is not None or len(projections) < 4 or not isinstance(norm, RMSNorm):
                return None  # q/k norms, a float projection, or no input norm (EAGLE-1/2's first layer)
            bias = attn.qkv_proj.bias
            qkv, o, gate_up, down = projections
            weights.append(cpu_layers.LayerWeights(qkv, o, gate_up, down, norm.weight.detach(),
                                                   layer.post_attention_layernorm.weight.detach(),
                                                   None if bias is None else bias.detach()))
        cfg = model.config
        if not weights or model.model.norm.weight.dtype != torch.float32:
            return None
        first = layers[0].self_attn
        shape = cpu_layers.Shape(cfg.hidden_size, first.heads, first.kv_heads, cfg.head_dim,
                                 cfg.intermediate_per_rank, cfg.rms_norm_eps, first.scale)
        return cls(cpu_layers.Stack(weights, shape), model)

    def serves(self, fb: ForwardBatch, h: torch.Tensor) -> bool:
        if torch.compiler.is_compiling():  # traced by torch.compile: the torch path, its products a custom op
            return False
        backend = fb.attn_backend
        return (h.shape[0] <= MAX_TOKENS and h.dtype == torch.float32 and not h.is_cuda
                and isinstance(backend, TorchRefBackend) and not backend.float64
                and fb.kv_pool.k[0].dtype == torch.float32)

    def __call__(self, h: torch.Tensor, fb: ForwardBatch, capture: tuple[int, ...]) -> list[torch.Tensor]:
        """Every layer over the embedded tokens `h` [T, hidden], in place: the stream
        leaving the last layer (before the final norm) is `h`; returns the streams
        entering the layers in `capture`."""
        meta = fb.attn_meta
        assert isinstance(meta, RefMeta), "the reference backend's metadata (serves() checked the backend)"
        assert self.rope.table is not None, "the rotary table is built with the model"
        self.stack.bind_cache(fb.kv_pool.k, fb.kv_pool.v)
        attn = cpu_layers.Attention(meta.kv_index, meta.q_index, meta.q_valid, meta.mask, fb.out_slots,
                                    fb.positions, self.rope.table)
        return self.stack.forward(h, attn, capture)
