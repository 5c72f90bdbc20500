"""A Llama-family model held in GGUF blocks runs its decoder layers on the CPU in one C
call a forward (kernels/cpu_layers.py) instead of some twenty torch ops a layer.

`build` is called by models/gguf_serve.py once the blocks are in place; it returns None
unless every layer can go (every projection in blocks the C stack reads; no per-head q/k
norms; float32; one tensor-parallel rank: the C call has no all-reduce). `serves` then takes
every forward of up to MAX_TOKENS tokens whose attention metadata is the reference backend's
(attention/torch_ref.py) over a float32 KV cache, torch.compile's included (there the call
is the custom op `specserve::cpu_stack`, which takes the running batch as
`specserve::attention` does, models/compile.py); only longer prefill chunks run the model's
torch path, whose products still read the blocks (models/quant_linear.py). The call also
applies the model's final norm (a torch op after it would run on caches the layers' weights
have just flushed); the head stays with the model.

`build_eagle3` makes the same one-call stack of an EAGLE-3 draft's midlayer held in blocks
(models/gguf_serve.py `quantize_draft`): its q/k/v product reads the normed token
embeddings beside the normed hidden (kernels/cpu_layers.c's `norm0`). The draft only
proposes, so its eager forwards take it where `serves` holds and torch elsewhere.

Invariant: a row's result does not depend on the forward it is in. The C stack computes
each row alone, and the products round their inputs to int16 (kernels/cpu_quant.py), which
turns a last-bit difference in an input into a step of the rounding: so decode steps,
verifies and prefill chunks take this one path, not a mix of it and torch's.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch

from specserve.attention.torch_ref import RefMeta, TorchRefBackend
from specserve.core import parallel, quant
from specserve.core.forward_batch import ForwardBatch
from specserve.kernels import cpu_layers
from specserve.models.layers import RMSNorm

if TYPE_CHECKING:
    from specserve.models.eagle3 import Eagle3MidLayer, LlamaForCausalLMEagle3
    from specserve.models.llama import Attention as AttentionLayer
    from specserve.models.llama import DecoderLayer, LlamaConfig, LlamaForCausalLM
    from specserve.models.rope import RotaryEmbedding

MAX_TOKENS = 2048  # more (a long prefill chunk) takes the torch path: its scratch grows with the tokens


class CpuStack:
    def __init__(self, stack: cpu_layers.Stack, rope: RotaryEmbedding, final_norm: torch.Tensor) -> None:
        self.stack = stack
        self.rope = rope
        self.final_norm = final_norm  # float32 [hidden], the model's norm after the last layer
        self.handle = id(self)  # the custom op's key (`_STACKS`)
        _STACKS[self.handle] = self
        weakref.finalize(self, _STACKS.pop, self.handle, None)

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> CpuStack | None:
        if parallel.tp_size() > 1:
            return None
        weights = []
        layers = list(cast("Iterable[DecoderLayer]", model.model.layers))  # ModuleList is untyped
        for layer in layers:
            attn, norm = layer.self_attn, layer.input_layernorm
            projections = _projections(layer)
            if projections is None or not isinstance(norm, RMSNorm):
                return None  # q/k norms, a float projection, or no input norm (EAGLE-1/2's first layer)
            bias = attn.qkv_proj.bias
            qkv, o, gate_up, down = projections
            weights.append(cpu_layers.LayerWeights(qkv, o, gate_up, down, norm.weight.detach(),
                                                   layer.post_attention_layernorm.weight.detach(),
                                                   None if bias is None else bias.detach()))
        final = model.model.norm
        if not weights or final.weight.dtype != torch.float32 or final.eps != model.config.rms_norm_eps:
            return None
        return cls(cpu_layers.Stack(weights, _shape(model.config, layers[0].self_attn)), model.model.rotary,
                   final.weight.detach())

    @classmethod
    def build_eagle3(cls, draft: LlamaForCausalLMEagle3) -> CpuStack | None:
        """The midlayer of an EAGLE-3 draft in one C call, or None unless its four
        projections are blocks the C stack reads, in float32, with the residual the
        incoming hidden (not vLLM's norm_before_residual)."""
        mid = draft.midlayer
        projections = _projections(mid) if parallel.tp_size() == 1 else None
        norms = (mid.input_layernorm, mid.hidden_norm, mid.post_attention_layernorm, draft.norm)
        if (projections is None or mid.self_attn.qkv_proj.bias is not None or mid.norm_before_residual
                or any(n.weight.dtype != torch.float32 for n in norms) or len({n.eps for n in norms}) != 1):
            return None
        qkv, o, gate_up, down = projections
        weights = cpu_layers.LayerWeights(qkv, o, gate_up, down, mid.hidden_norm.weight.detach(),
                                          mid.post_attention_layernorm.weight.detach(), None,
                                          norm0=mid.input_layernorm.weight.detach())
        return cls(cpu_layers.Stack([weights], _shape(draft.config, mid.self_attn)), draft.rotary,
                   draft.norm.weight.detach())

    def serves(self, fb: ForwardBatch, h: torch.Tensor) -> bool:
        backend = fb.attn_backend
        return (h.shape[0] <= MAX_TOKENS and h.dtype == torch.float32 and not h.is_cuda
                and isinstance(backend, TorchRefBackend) and not backend.float64
                and fb.kv_pool.k[0].dtype == torch.float32)

    def __call__(self, h: torch.Tensor, fb: ForwardBatch, capture: tuple[int, ...]
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every layer over the embedded tokens `h` [T, hidden] (in place where eager), then
        the final norm: (the normed stream leaving the last layer; the streams entering
        the layers in `capture`)."""
        if torch.compiler.is_compiling():
            out = torch.ops.specserve.cpu_stack(h, self.handle, list(capture))
            return out[0], list(out[1:].unbind(0))
        return self.run(h, fb, capture)

    def run(self, h: torch.Tensor, fb: ForwardBatch, capture: tuple[int, ...],
            embed: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`__call__` eagerly: h updated in place (the stream leaving the last layer), and
        returned: (its final-normed copy, the captured streams); `embed` the tokens'
        embeddings [T, hidden] for an EAGLE-3 midlayer (`build_eagle3`)."""
        meta = fb.attn_meta
        assert isinstance(meta, RefMeta), "the reference backend's metadata (serves() checked the backend)"
        assert self.rope.table is not None, "the rotary table is built with the model"
        self.stack.bind_cache(fb.kv_pool.k, fb.kv_pool.v)
        attn = cpu_layers.Attention(meta.kv_index, meta.q_index, meta.q_valid, meta.mask, fb.out_slots,
                                    fb.positions, self.rope.table)
        normed = torch.empty_like(h)
        return normed, self.stack.forward(h, attn, capture, embed=embed, final=(self.final_norm, normed))


def _projections(layer: DecoderLayer | Eagle3MidLayer) -> list[quant.QuantWeight] | None:
    """A layer's q/k/v, o, gate/up and down weights when the C stack reads all four (in
    blocks it serves, no per-head q/k norms), else None."""
    attn, mlp = layer.self_attn, layer.mlp
    found = [p.quantized for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    projections = [p for p in found if p is not None and cpu_layers.servable(p)]
    return projections if len(projections) == 4 and attn.q_norm is None else None


def _shape(cfg: LlamaConfig, attn: AttentionLayer) -> cpu_layers.Shape:
    return cpu_layers.Shape(cfg.hidden_size, attn.heads, attn.kv_heads, cfg.head_dim, cfg.intermediate_per_rank,
                            cfg.rms_norm_eps, attn.scale)


_STACKS: dict[int, CpuStack] = {}  # CpuStack.handle -> the stack, for the custom op


@torch.library.custom_op("specserve::cpu_stack", mutates_args=())
def _stack_op(h: torch.Tensor, handle: int, capture: list[int]) -> torch.Tensor:
    """The running compiled batch's layers over a copy of h: [1 + len(capture), T, hidden],
    the normed stream leaving the last layer, then the captured ones. Like
    `specserve::attention` it writes the batch's new keys and values into the pool, which
    torch does not see."""
    from specserve.models import compile as compiled

    fb = compiled.running_batch()
    normed, captured = _STACKS[handle].run(h.clone(), fb, tuple(capture))
    return torch.stack([normed, *captured])


@_stack_op.register_fake
def _(h: torch.Tensor, handle: int, capture: list[int]) -> torch.Tensor:
    return h.new_empty(1 + len(capture), *h.shape)
