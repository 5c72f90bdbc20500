"""A decoder stack held in GGUF blocks, run on the CPU in one C call a forward
(`cpu_layers.c`, compiled with `cpu_quant.c` by kernels/cpu_quant.py).

On the CPU a few-token forward spent more time launching torch ops (a norm, RoPE, the
KV write, SDPA, SiLU, the adds: some twenty a layer) than multiplying; this runs them all
in C, in one OpenMP region. The caller (models/cpu_stack.py) hands it plain tensors:
each layer's `LayerWeights`, the KV cache, and the attention metadata of
attention/torch_ref.py. `Stack` builds the C structures once and rebinds only the KV
cache when it changes.

Invariants: the stream is float32 and updated in place; every tensor handed over stays
alive (the Stack keeps the weights; `forward` keeps its batch's tensors until the call
returns); a row's result does not depend on the other rows of the batch.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from specserve.core import quant
from specserve.kernels import cpu_quant

_I, _F, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
SUB = 4  # cpu_layers.c: query heads a pass over a KV head's keys (its attention scratch is sized by it)


class _QW(ctypes.Structure):
    _fields_ = [("method", _I), ("N", _I), ("K", _I), ("group", _I), ("half", _I), ("has_offset", _I), ("data", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _QW), ("o", _QW), ("gate_up", _QW), ("down", _QW), ("norm1", _P), ("norm2", _P),
                ("qkv_bias", _P), ("k_cache", _P), ("v_cache", _P), ("norm0", _P)]


class _Batch(ctypes.Structure):
    _fields_ = [("T", _I), ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("inter", _I),
                ("eps", _F), ("scale", _F), ("rope", _P), ("positions", _P), ("out_slots", _P),
                ("B", _I), ("max_new", _I), ("max_kv", _I), ("kv_index", _P), ("q_index", _P), ("q_valid", _P),
                ("mask", _P), ("embed", _P), ("xn", _P), ("qkv", _P), ("attn", _P), ("gate_up", _P),
                ("act", _P), ("scores", _P), ("xq", _P), ("xd", _P), ("xs", _P)]


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float
    scale: float  # attention's softmax scale


@dataclass(frozen=True)
class LayerWeights:
    qkv: quant.QuantWeight  # [(heads + 2 kv_heads) * head_dim, hidden]
    o: quant.QuantWeight
    gate_up: quant.QuantWeight  # gate's rows, then up's
    down: quant.QuantWeight
    norm1: torch.Tensor  # float32 [hidden]
    norm2: torch.Tensor
    qkv_bias: torch.Tensor | None
    norm0: torch.Tensor | None = None  # EAGLE-3's midlayer: q/k/v read [norm0(embed), norm1(stream)]


@dataclass(frozen=True)
class Attention:
    """attention/torch_ref.py's metadata for one forward (its `RefMeta`), plus where the new
    keys go and the rotary table at the forward's positions."""
    kv_index: torch.Tensor  # int64 [B, max_kv]
    q_index: torch.Tensor  # int64 [B, max_new]
    q_valid: torch.Tensor  # bool [B * max_new]
    mask: torch.Tensor | None  # bool, B * max_new * max_kv elements
    out_slots: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    rope_table: torch.Tensor  # float32 [max_positions, 2 head_dim]


def servable(qw: quant.QuantWeight) -> bool:
    """Whether the C stack reads this weight (kernels/cpu_quant.py `servable`)."""
    return cpu_quant.servable(qw)


def _qw(qw: quant.QuantWeight) -> _QW:
    w = cpu_quant.pack(qw)
    return _QW(cpu_quant.METHODS[w.method], w.n, w.k, w.group, int(w.half), int(w.has_offset), w.data.data_ptr())


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class Stack:
    def __init__(self, layers: list[LayerWeights], shape: Shape) -> None:
        self.shape, self.weights = shape, layers  # kept alive: the structures point into them
        self.layers = (_Layer * len(layers))()
        for c, w in zip(self.layers, layers):
            c.qkv, c.o, c.gate_up, c.down = _qw(w.qkv), _qw(w.o), _qw(w.gate_up), _qw(w.down)
            c.norm1, c.norm2, c.qkv_bias = w.norm1.data_ptr(), w.norm2.data_ptr(), _ptr(w.qkv_bias)
            c.norm0 = _ptr(w.norm0)
        self.paired = any(w.norm0 is not None for w in layers)  # then forward takes the tokens' embeddings
        self._cache: tuple[int, ...] = ()
        self._bound: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def bind_cache(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """Point each layer at its float32 K and V cache [slots, kv_heads, head_dim]."""
        if self._bound is not None and self._bound[0] is k and self._bound[1] is v:
            return  # the pool's own lists, as bound last time (a pool's tensors are never replaced)
        ptrs = tuple(t.data_ptr() for t in (*k, *v))
        if ptrs != self._cache:
            for i, c in enumerate(self.layers):
                c.k_cache, c.v_cache = k[i].data_ptr(), v[i].data_ptr()
            self._cache = ptrs
        self._bound = (k, v)

    def forward(self, stream: torch.Tensor, attn: Attention, capture: tuple[int, ...] = (),
                threads: int | None = None, embed: torch.Tensor | None = None,
                final: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Run every layer over `stream` [T, hidden] in place; returns the streams entering
        the layers in `capture` (len(layers): leaving the last). `embed` [T, hidden] float32:
        the tokens' embeddings, which a stack with a `norm0` layer takes (EAGLE-3's).
        `final` (weight [hidden], out [T, hidden], float32): out takes the stream leaving
        the last layer normed (RMSNorm, the layers' eps) by weight."""
        lib = cpu_quant.library()
        assert lib is not None and stream.dtype == torch.float32 and stream.is_contiguous()
        assert (embed is not None) == self.paired, "cpu_layers: embeddings go with a norm0 layer, only"
        assert embed is None or (embed.dtype == torch.float32 and embed.is_contiguous() and embed.shape == stream.shape)
        s, t = self.shape, stream.shape[0]
        xn = 2 * s.hidden if self.paired else s.hidden  # the first norm's width
        nthreads = threads or torch.get_num_threads()
        bsz, max_new = attn.q_index.shape
        max_kv = attn.kv_index.shape[1]
        width = (s.heads + 2 * s.kv_heads) * s.head_dim
        scores = nthreads * (SUB + 2) * max_kv + t * s.heads * 2 * (s.head_dim + 2)  # cpu_layers.c's attention scratch
        scratch = torch.empty(t * (xn + width + s.heads * s.head_dim + 3 * s.inter) + scores)
        sizes = [t * xn, t * width, t * s.heads * s.head_dim, t * 2 * s.inter, t * s.inter, scores]
        parts = torch.split(scratch, sizes)
        mask = None if attn.mask is None else attn.mask.contiguous()
        keep = (attn.kv_index.contiguous(), attn.q_index.contiguous(), attn.q_valid.contiguous(), mask,
                attn.out_slots.contiguous(), attn.positions.contiguous())
        ints = (keep[0], keep[1], keep[4], keep[5])
        assert all(x.dtype == torch.int64 for x in ints) and all(x.dtype == torch.bool for x in keep[2:4]
                                                                   if x is not None), "cpu_layers: index dtypes"
        assert attn.rope_table.dtype == torch.float32 and attn.rope_table.shape[1] == 2 * s.head_dim
        widest = max(xn, s.heads * s.head_dim, s.inter)
        rounded = (torch.empty(t, widest, dtype=torch.int16), torch.empty(t, widest // cpu_quant.XBLOCK),
                   torch.empty(t, widest // 16))
        batch = _Batch(t, s.hidden, s.heads, s.kv_heads, s.head_dim, s.inter, s.eps, s.scale,
                       attn.rope_table.data_ptr(), keep[5].data_ptr(), keep[4].data_ptr(), bsz, max_new, max_kv,
                       keep[0].data_ptr(), keep[1].data_ptr(), keep[2].data_ptr(), _ptr(mask), _ptr(embed),
                       *(p.data_ptr() for p in parts), *(r.data_ptr() for r in rounded))
        captured = torch.empty(len(capture), t, s.hidden)
        where = (ctypes.c_int64 * max(1, len(capture)))(*capture)
        if final is not None:
            assert all(x.dtype == torch.float32 and x.is_contiguous() for x in final) and final[1].shape == stream.shape
        rc = lib.cpu_layers_forward(self.layers, len(self.layers), ctypes.byref(batch), stream.data_ptr(), where,
                                    len(capture), captured.data_ptr(), nthreads,
                                    *((None, None) if final is None else (final[0].data_ptr(), final[1].data_ptr())))
        if rc != 0:
            raise ValueError(f"cpu_layers: head_dim {s.head_dim} is past the C stack's limit")
        return list(captured.unbind(0))
