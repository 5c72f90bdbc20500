"""Fused Triton kernels for the model's small per-layer ops, and the switch that picks them.

Owns the decision "fused kernel or torch path" (`use_fused`) and thin entry points that
import the Triton modules on first call, so this package imports without triton. The
kernels (`norm.py`, `activation.py`, `rope.py`, `matvec.py`, `skinny.py`, `embed.py`, `topk.py`,
`frontier.py`, `node_select.py`, `gumbel.py`, `argmax.py`, `walk.py`) replace chains of small launches on CUDA: per
decoder layer, add+RMSNorm twice, RoPE with the KV-cache write once, SiLU*mul once (at
one token the norms, the SiLU*mul and the residual adds ride on the linear layers' GEMVs
instead: `matvec.py`); per tree-drafting depth, the children's top-k log-probabilities
(`topk.py`) and the frontier's bookkeeping (`frontier.py`), per pass the kept nodes and
their ancestor masks (`node_select.py`); per sampled step, the seeded Gumbel noise
(`gumbel.py`), or the whole Gumbel-max draw without storing the noise (`argmax.py`); per
verify, the greedy accept walk (`walk.py`), over seeded sampling's targets too. Per pipelined
step of drafts matched from a request's own tokens, the commit and the match (`suffix.py`). Under
--enable-deterministic-inference every linear layer runs `invariant_mm.py` instead of the
GEMVs and cuBLAS (fp8 weights too; quantized blocks: `blocks_x16.py` at any row count): its
rows' arithmetic does not depend on how many rows there are.
The model files call these only when `use_fused(tensor)` says so; everywhere else
(CPU) they keep their exact torch path.

The switch: automatic (CUDA tensors and triton importable) unless overridden, first by
`fused_kernels(enabled)` (a context manager, for tests), then by the environment variable
SPECSERVE_FUSED_KERNELS=0/1 read at import. Forcing it on for CPU tensors only works
with TRITON_INTERPRET=1 set before triton is first imported (the tests do this).
"""
from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from specserve.core import env
from specserve.core.quant import QuantWeight

if TYPE_CHECKING:
    from specserve.core.rope import RopeAt

_override: bool | None = env.fused_kernels_override()
_triton_ok: bool | None = None  # cached find_spec("triton")


def triton_available() -> bool:
    global _triton_ok
    if _triton_ok is None:
        try:
            _triton_ok = importlib.util.find_spec("triton") is not None
        except (ImportError, ValueError):  # a finder that refuses it, or a broken half-import
            _triton_ok = False
    return _triton_ok


def use_fused(t: torch.Tensor) -> bool:
    """Whether ops on `t` should go through the fused kernels: never while torch.compile
    traces (inductor fuses the torch-native ops itself: models/compile.py)."""
    if torch.compiler.is_compiling():
        return False
    if _override is not None:
        return _override
    return t.is_cuda and triton_available()


@contextmanager
def fused_kernels(enabled: bool | None) -> Iterator[None]:
    """Force the fused kernels on (True) or off (False), or restore automatic (None), in a block."""
    global _override
    saved, _override = _override, enabled
    try:
        yield
    finally:
        _override = saved


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., N]; our `RMSNorm` semantics (see norm.py)."""
    from specserve.kernels import norm

    return norm.rms_norm(x, weight, eps)


def rms_norm_pair(a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor, eps: float,
                  ids: torch.Tensor | None = None) -> torch.Tensor:
    """cat([RMSNorm(a; wa), RMSNorm(b; wb)], -1) for a, b [T, N] in one launch (norm.py):
    EAGLE-3's midlayer input; with `ids` [T], a is the embedding table, gathered at ids."""
    from specserve.kernels import norm

    return norm.rms_norm_pair(a, wa, b, wb, eps, ids)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x), residual + x) in one launch; the sum rounded to x's dtype."""
    from specserve.kernels import norm

    return norm.fused_add_rms_norm(x, residual, weight, eps)


SKINNY_MAX_TOKENS = 32  # skinny.py pads tokens to 16 or 32
# The widest activations the few-token path takes with pointer loads: narrow models'
# layers are latency-bound and gain from the fused forms, while wide ones (4096 and up)
# are bandwidth-bound and stream their weights faster through cuBLAS than through
# pointer-loaded tiles. Wider layers take the few-token path only where their weights
# stream through TMA descriptors (`tma_enabled`, skinny.use_tma).
SKINNY_MAX_WIDTH = 2048
_HOPPER: dict[int | None, bool] = {}  # device index -> compute capability >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` use programmatic dependent launch: on Hopper and
    later unless SPECSERVE_PDL=0. A PDL kernel may start before the kernel ahead of it
    ends (once that one has signalled with gdc_launch_dependents, or ended) and waits
    (gdc_wait) before reading anything an earlier kernel wrote. Every Triton kernel of a
    decoder layer takes it (the GEMVs, norms, SiLU*mul, RoPE + KV write, attention and its
    split merge), so their launches overlap the kernel before: a small model's step is
    bound by launch latency, which the overlap hides. Captured step and prefill graphs
    are token-identical with and without it (tests/unit/test_spec_pipeline.py,
    test_fused_kernels.py)."""
    return device.type == "cuda" and env.pdl_allowed() and _hopper(device)


def _hopper(device: torch.device) -> bool:
    """Whether CUDA `device` is Hopper or later (compute capability 9+), read once per device."""
    if device.index not in _HOPPER:
        _HOPPER[device.index] = torch.cuda.get_device_capability(device)[0] >= 9
    return _HOPPER[device.index]


def pdl_flags(device: torch.device) -> dict:
    """A Triton kernel's launch flags for `pdl_enabled`: the kernel takes a USE_PDL
    constexpr and, when it is set, calls gdc_wait before it reads anything an earlier
    kernel wrote (and gdc_launch_dependents to let the next one start)."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"USE_PDL": False}


def tma_enabled(device: torch.device) -> bool:
    """Whether the few-token kernel may stream weights through TMA descriptors (skinny.py):
    on Hopper and later unless SPECSERVE_TMA=0."""
    return device.type == "cuda" and env.tma_allowed() and _hopper(device)


def use_gemv(x: torch.Tensor, lm_head: bool = False) -> bool:
    """Whether linear layers on activations `x` [T, K] run as fused GEMVs: one token
    (matvec.py), or up to SKINNY_MAX_TOKENS (skinny.py, unless SPECSERVE_SKINNY=0) of at
    most SKINNY_MAX_WIDTH, or of any width where TMA streams the wide weights
    (`tma_enabled`), on the fused kernels' side of the switch. An lm_head (`lm_head`)
    takes the few-token kernel at any width: its many rows give every SM whole tiles, so
    even a wide model's head streams at least as fast with pointer loads as through cuBLAS.
    float32 on a GPU past one token only up to SKINNY_MAX_WIDTH, lm_heads too: skinny.py's
    3xTF32 tiles beat cuBLAS's float32 GEMM on a narrow model's layers, and wide ones stream
    through cuBLAS (no TMA path for float32 weights)."""
    if x.dim() != 2 or not use_fused(x):
        return False
    t, width = x.shape
    if t > 1 and x.is_cuda and x.dtype == torch.float32 and width > SKINNY_MAX_WIDTH:
        return False
    return t == 1 or (2 <= t <= SKINNY_MAX_TOKENS and env.skinny_allowed()
                      and (lm_head or width <= SKINNY_MAX_WIDTH or tma_enabled(x.device)))


def gemv(x: torch.Tensor, weight: torch.Tensor | QuantWeight, *, norm_weight: torch.Tensor | None = None,
         eps: float = 0.0, residual: torch.Tensor | None = None, gated: bool = False,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, K] @ weight [N, K].T with a fused pre-norm, residual add or SiLU-and-mul:
    matvec.py for one token, skinny.py for a few, and for one token through a narrow
    model's lm_head (`_narrow_head`). An fp8 weight (core/quant.py) is read as stored."""
    from specserve.kernels import matvec, skinny

    if isinstance(weight, QuantWeight) and weight.method in _PACKED:
        return _packed_gemv(x, weight, norm_weight, eps, residual, gated, out_dtype)
    if x.numel() == x.shape[-1] and not _narrow_head(weight, gated):
        return matvec.gemv(x, weight, norm_weight=norm_weight, eps=eps, residual=residual, out_dtype=out_dtype,
                           gated=gated)
    x = x.reshape(-1, x.shape[-1])
    return skinny.skinny(x, weight, norm_weight=norm_weight, eps=eps, residual=residual.reshape(x.shape[0], -1)
                         if residual is not None else None, gated=gated, out_dtype=out_dtype)


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None, **fused: Any) -> Any:
    """x [M, K] @ weight [N, K].T (+ bias) with each row's arithmetic independent of M, and
    the prologues and epilogues `fused` names (invariant_mm.py: --enable-deterministic-inference)."""
    from specserve.kernels import invariant_mm

    return invariant_mm.invariant_matmul(x, weight, bias, out_dtype, **fused)


def invariant_quantized_serve(qw: QuantWeight, dtype: torch.dtype) -> bool:
    """Whether the mode's kernels multiply `qw` (on the GPU) with activations of `dtype`:
    fp8 through `invariant_matmul`, blocks through `invariant_blocks`; half activations."""
    if not (qw.data.is_cuda and triton_available() and dtype in (torch.bfloat16, torch.float16)):
        return False
    from specserve.kernels import blocks_x16, invariant_mm

    return invariant_mm.fp8_scales_served(qw) or blocks_x16.serves(qw, dtype)


def invariant_blocks(x: torch.Tensor, qw: QuantWeight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] (half) times a GGUF's blocks or an AWQ/GPTQ weight held as q4 [N, K] with each
    row's arithmetic independent of M (--enable-deterministic-inference): blocks_x16.py's
    product at any M, whose rows take the same operations whatever the rows beside them."""
    from specserve.kernels import blocks_x16

    return blocks_x16.gemv_x16(x, qw, out_dtype=out_dtype)


def row_sumsq(x: torch.Tensor) -> torch.Tensor:
    """Partial sums of squares of x's rows, for an invariant norm prologue (invariant_mm.py)."""
    from specserve.kernels import invariant_mm

    return invariant_mm.row_sumsq(x)


_PACKED = ("int4", "q4", "q8")  # core/quant.py's methods whose few-token kernels fuse no norm or SiLU


def packed_matmul(x: torch.Tensor, qw: QuantWeight, *, residual: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, K] times an int4 (int4.py) or GGUF-block (q4, q8: blocks.py) weight [N, K]
    -> [T, N], plus residual; rows past 32 are further programs streaming the weight again."""
    if qw.method == "int4":
        from specserve.kernels import int4

        return int4.int4_matmul(x, qw, residual=residual, out_dtype=out_dtype)
    from specserve.kernels import blocks

    return blocks.blocks_matmul(x, qw, residual=residual, out_dtype=out_dtype)


def _packed_gemv(x: torch.Tensor, qw: QuantWeight, norm_weight: torch.Tensor | None, eps: float,
                 residual: torch.Tensor | None, gated: bool, out_dtype: torch.dtype | None) -> torch.Tensor:
    """`gemv`'s fused forms over an int4 or GGUF-block weight as separate launches, each
    rounding as its torch op: the norm, then the product (+ residual), then SiLU*mul. A
    few tokens of half x on q4 or q8 (blocks_x16.py) fuse the norm into their rounding to
    int16 and SiLU*mul into the product."""
    x = x.reshape(-1, x.shape[-1])
    from specserve.kernels import blocks_x16

    if blocks_x16.takes(x, qw):  # the norm in the launch that rounds x to int16, SiLU*mul in the product's
        return blocks_x16.gemv_x16(x, qw, norm_weight=norm_weight, eps=eps, gated=gated, out_dtype=out_dtype,
                                   residual=residual.reshape(x.shape[0], -1) if residual is not None else None)
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    if gated:
        return silu_and_mul(packed_matmul(x, qw)).to(out_dtype or x.dtype)
    return packed_matmul(x, qw, residual=residual.reshape(x.shape[0], -1) if residual is not None else None,
                         out_dtype=out_dtype)


def _narrow_head(weight: torch.Tensor | QuantWeight, gated: bool) -> bool:
    """Whether a one-token product with `weight` takes skinny.py's tiles rather than the
    GEMV: an lm_head (16384 rows or more) no wider than SKINNY_MAX_WIDTH. The GEMV's
    two-row programs stream such a head's many short rows well below the bandwidth that
    skinny.py's 128-row tiles reach."""
    return (not gated and weight.shape[0] >= 16384 and weight.shape[1] <= SKINNY_MAX_WIDTH
            and env.skinny_allowed())


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight[ids] for ids [T]: one gather launch (embed.py)."""
    from specserve.kernels import embed

    return embed.embedding(ids, weight)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
    from specserve.kernels import activation

    return activation.silu_and_mul(gate_up)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by (cos, signed sin) [T, 1, D] from `RotaryEmbedding.lookup`."""
    from specserve.kernels import rope

    return rope.apply_rope(x, cos, sin)


def rope_store_kv(qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, *, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> torch.Tensor:
    """RoPE on qkv [T, heads + 2 kvH, D]'s queries and keys, keys and values stored at
    k_cache/v_cache[slots] (an fp8 cache: divided by k_scale / v_scale); returns the
    rotated queries [T, heads, D] (rope.py)."""
    from specserve.kernels import rope

    return rope.rope_store_kv(qkv, heads, cos, sin, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)


def qkv_rope_store(x: torch.Tensor, weight: torch.Tensor | QuantWeight, heads: int, rope: RopeAt,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, *,
                   norm_weight: torch.Tensor | None = None, eps: float = 0.0, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> torch.Tensor | None:
    """`gemv` of x [T, K] (2 <= T <= SKINNY_MAX_TOKENS) through an attention layer's fused
    qkv weight, then `rope_store_kv` at the rope's positions (`models.rope.RopeAt`), in one
    launch (qkv_rope.py): the rotated queries [T, heads, D]. None where it does not apply
    (one token: the GEMV's layout; head dims that are not a multiple of 16; weights on
    TMA), for the caller's two launches."""
    from specserve.kernels import qkv_rope, skinny

    # A wide weight streamed by TMA: the projection and RoPE apart (qkv_rope.py's programs
    # take interleaved rows, which pointer loads serve)
    stored = weight.data if isinstance(weight, QuantWeight) else weight
    if isinstance(weight, QuantWeight) and weight.method in _PACKED:  # no fused form: the caller's two launches
        return None
    if x.shape[0] < 2 or not qkv_rope.supports(k_cache.shape[-1]) or skinny.use_tma(stored):
        return None
    return qkv_rope.qkv_rope_store(x, weight, heads, rope, k_cache, v_cache, slots, norm_weight=norm_weight, eps=eps,
                                   k_scale=k_scale, v_scale=v_scale)


def topk_logprobs(logits: torch.Tensor, k: int, token_map: torch.Tensor | None = None,
                  into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(log-softmax values float32 [R, k], ids int64 [R, k]) of each row's k largest logits,
    ids through `token_map` when given, also written to rows `into[0]` of into[1:] when
    given, in two launches (topk.py); None when the row is too long for the kernel (the
    caller takes its torch path)."""
    from specserve.kernels import topk

    if not topk.supports(logits.shape[-1], k):
        return None
    return topk.topk_logprobs(logits, k, token_map, into)


def tree_frontier(score: torch.Tensor, logp: torch.Tensor, kid: torch.Tensor, frontier: torch.Tensor, size: int,
                  states: torch.Tensor | None, tail: torch.Tensor | None, next_slots: torch.Tensor | None,
                  cand: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                  first_tokens: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One tree-drafting depth's children into the pass's candidate buffers `cand`, its next
    frontier and moved branch states and tails, in one launch (frontier.py;
    `spec.tree_draft._advance` is the reference)."""
    from specserve.kernels import frontier as f

    return f.tree_frontier(score, logp, kid, frontier, size, states, tail, next_slots, cand, first_tokens)


def tree_select(roots: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                n_sel: int, max_depth: int, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A drafting pass's best n_sel candidates as trees [B, 1 + n_sel] (tokens, parents)
    and their ancestor masks, in one launch (node_select.py; `spec.tree_draft._select`
    is the reference); into `out` when given."""
    from specserve.kernels import node_select

    return node_select.tree_select(roots, scores, tokens, parents, n_sel, max_depth, out)


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, width: int) -> torch.Tensor:
    """[R, width] float32 -log(-log(runner.sampler.uniform_noise(seeds, counters, width)))
    in one launch (gumbel.py)."""
    from specserve.kernels import gumbel

    return gumbel.gumbel_noise(seeds, counters, width)


@dataclass(frozen=True)
class Tempered:
    """Seeded sampling's view of logits rows (argmax.py): row r belongs to request
    r // per_request (a verify's nodes share their request's params) and draws its
    Gumbel noise under its own counter."""

    temperature: torch.Tensor  # [Q] float32 (rows of greedy requests ignore it)
    greedy: torch.Tensor  # [Q] bool: these requests' rows keep their logits
    seeds: torch.Tensor  # [Q] int64
    counters: torch.Tensor  # [R] int64: each row's output index, its noise key
    per_request: int = 1
    floors: torch.Tensor | None = None  # [R] float32: logits below a row's floor are never drawn


def filter_floors(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, per_request: int = 1) -> torch.Tensor:
    """[R] float32: the smallest logit each row of logits [R, V] keeps under its request's
    top-k, top-p and min-p (-inf: every one), with no sort, in one launch, or a few where
    few rows would leave the GPU idle (filters.py; `runner.sampler.filter_floors` is the
    reference)."""
    from specserve.kernels import filters

    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return filters.filter_floors(logits, temperature, top_k, top_p, min_p, per_request)


def sampled_argmax(logits: torch.Tensor, tempered: Tempered) -> torch.Tensor:
    """[R] int64: argmax of logits [R, V] / T + seeded Gumbel noise (greedy rows: of the
    logits), the noise never stored, in two launches (argmax.py)."""
    from specserve.kernels import argmax

    return argmax.argmax(logits, tempered)


def greedy_walk(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, mask: torch.Tensor,
                logits: torch.Tensor, tempered: Tempered | None = None) -> torch.Tensor | None:
    """The greedy accept walk of [B, N] trees (ancestor masks [B, N, N]) given the
    target's logits [B, N, V]: int64 [B, 2N + 1] rows [on_path, tokens, bonus] in two
    launches (walk.py); with `tempered`, over seeded sampling's targets (an exact
    sampled verify). None when the trees are too large for the kernel (the caller takes
    its torch path)."""
    from specserve.kernels import walk

    if not walk.supports(tokens.shape[1]):
        return None
    return walk.greedy_walk(tokens, parents, valid, mask, logits, tempered)


def suffix_match(ids: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, max_w: int, min_w: int,
                 n: int) -> torch.Tensor:
    """[B, n] int64: per request, the token at lens - 1 of its row of `ids` [R, C] int64 and
    the n - 1 tokens after its suffix's best earlier match (suffix.py), one launch.
    rows, lens [B] int64 on ids' device, 1 <= lens <= C; 1 <= min_w <= max_w."""
    from specserve.kernels import suffix as sm

    return sm.suffix_match(ids, rows, lens, max_w, min_w, n)


def commit_and_match(on_path: torch.Tensor, tokens: torch.Tensor, bonus: torch.Tensor, slots: torch.Tensor,
                     row_start: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, max_w: int,
                     min_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A greedy walk over chains of N nodes committed on the device, and the next chains, in
    one launch (suffix.py): on_path [B, N] (nonzero on the root and the accepted
    nodes, a prefix of each chain; rows may be strided), tokens [B, N], bonus [B], slots
    [B, N] contiguous, row_start [2B] the table rows then kv_lens before the verify. Writes
    the kept slots into `table` at kv_len .. and the committed tokens (the accepted nodes',
    then the bonus) into `ids` at kv_len + 1 .. Returns the next chains [B, N]
    (`suffix_match` from the bonus) and kv_len after [B]."""
    from specserve.kernels import suffix as sm

    return sm.commit_and_match(on_path, tokens, bonus, slots, row_start, table, ids, max_w, min_w)
