"""Few-token linear layers (2 to 32 tokens): y = W x as `matvec.py` does for one, on tl.dot.

A verify of a 16- or 32-node tree, or a decode step of a few requests, still streams the
whole weight for a handful of tokens, so it is as bandwidth-bound as a GEMV; cuBLAS picks
GEMM kernels for it. Each program here owns BLOCK_N weight rows and multiplies them into
the tokens padded to 16 or 32 (acc [BLOCK_N, BLOCK_T] = W_tile @ x_tile^T: tl.dot wants
16 or more on every side). The plain kernel streams such weights at least as fast as
cuBLAS's GEMM kernels do at these token counts.

The fused forms and their rounding are `matvec.py`'s (norm prologue per token, gated
SiLU*mul, residual add), so a layer run this way is the one-token layer for T tokens;
past one tile of 16 tokens the norm is deferred (`product`): its weight scales x before
the dot, its rsqrt the product after, so no program normalises all T tokens before its
first dot (such a pre-pass costs more than norm.py's own launch, where the deferred norm
costs little more than the plain product). On by default (SPECSERVE_SKINNY=0 turns it
off): a narrow model's verify runs faster this way than through cuBLAS with the separate
norms and SiLU*mul. A row of up to 1024 takes one tile (`_config`).

float32 dots run as 3xTF32 (F32): each operand split in a TF32 head and tail, three
tensor-core products summed in fp32, which lands as close to a float64 reference as IEEE
fp32 dots do (Triton runs those on the FMA units, several times slower at these shapes).
On a GPU they take small tiles with K split (`skinny_config.f32_config`).

K may be split over programs (grid axis 1, `split_range`): each multiplies its part of
the columns and the last of a row block's programs to finish sums the fp32 parts in a
fixed order (`split_sum`, through a per-device counter), then applies the epilogue.
A narrow layer with long rows (SmolLM2's down_proj: 576 rows, K 1536) has too few
programs of 16 rows (36) to stream its weight; split 3 ways, each part one 512-deep tile
fetched before the PDL wait, it runs on three times as many. Narrow layers with short
rows (K 576) gain nothing from a split.

Wide weights (both sides past kernels.SKINNY_MAX_WIDTH) stream through TMA descriptors on
Hopper and later (`use_tma`, `_tma_config`): pointer loads feed such layers below what
cuBLAS reaches, and the descriptor's boxes bring a wide model's verify closer to the cost
of a decode step than cuBLAS does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from specserve.core.quant import QuantWeight
from specserve.kernels import SKINNY_MAX_TOKENS as MAX_TOKENS
from specserve.kernels import SKINNY_MAX_WIDTH, pdl_flags, tma_enabled
from specserve.kernels.matvec import unpack
from specserve.kernels.pdl import prefetch_l2, prefetch_step, wait_and_release
from specserve.kernels.skinny_config import MAX_ROW_BLOCKS, Config, split_buffers  # noqa: F401  (re-exported)
from specserve.kernels.skinny_config import config as _config
from specserve.kernels.skinny_config import counts as _counts  # noqa: F401  (tests read it)
from specserve.kernels.skinny_config import tma_config as _tma_config

_HALF = (torch.float16, torch.bfloat16)


@triton.jit
def _norm_weight(nw_ptr, cols, kmask, NORM: tl.constexpr):
    """The norm's weight [BLOCK_K] in fp32 at `cols` (ones without a norm)."""
    g = tl.full(cols.shape, 1.0, tl.float32)
    if NORM:
        g = tl.load(nw_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
    return g


@triton.jit
def _normed(x, g, rstd, NORM: tl.constexpr, HALF: tl.constexpr, DTYPE: tl.constexpr):
    """x [BLOCK_T, BLOCK_K] fp32, normalised per token as norm.py rounds it when NORM
    (g: the norm's weight [BLOCK_K]; rstd all ones: only scaled by it, the deferred form)."""
    if NORM:
        if HALF:  # normalise, round, then scale by the weight and round
            x = (g[None, :] * (x * rstd[:, None]).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
        else:
            x = x * rstd[:, None] * g[None, :]
    return x


@triton.jit
def _x_tile(x_ptr, toks, tmask, cols, kmask, sx):
    """x[toks, cols] in fp32 [BLOCK_T, BLOCK_K]; 0 where masked."""
    return tl.load(x_ptr + toks[:, None] * sx + cols[None, :], mask=tmask[:, None] & kmask[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _dot(w, xt, acc, F32: tl.constexpr):
    if F32:  # float32 operands: 3xTF32 (the module docstring)
        acc = tl.dot(w, xt, acc, input_precision="tf32x3")
    else:
        acc = tl.dot(w, xt, acc)
    return acc


@triton.jit
def _dot_operand(w, s_ptr, rows, rmask, cols, kmask, ss, GROUP, SCALES: tl.constexpr, DOT: tl.constexpr):
    """A weight tile as tl.dot's operand in DOT's dtype: fp8 widened exactly (to fp16 for
    half activations: `_dot_x`), times its group scales when SCALES is 2 (block scales; cols
    are absolute columns). SCALES 0 and 1 (none, one a row) leave the tile's values as they are."""
    if SCALES == 2:
        s = tl.load(s_ptr + rows[:, None] * ss + cols[None, :] // GROUP, mask=rmask[:, None] & kmask[None, :],
                    other=0.0)
        w = w.to(tl.float32) * s
    return w.to(DOT)


@triton.jit
def _dot_x(x, DOT: tl.constexpr, SCALES: tl.constexpr):
    """Activations x (fp32, each value already rounded to the activations' dtype) as tl.dot's
    operand: an fp8 weight's half activations meet it in fp16, which holds every bf16 value
    from 2^-14 to 65504 exactly; larger ones saturate there (an fp8 layer's inputs are normed
    states or products of them, far below it)."""
    if SCALES > 0 and DOT == tl.float16:
        x = tl.clamp(x, -65504.0, 65504.0)
    return x.to(DOT)


@triton.jit
def row_scaled(acc, acc_up, s_ptr, rows, rmask, N, ss, GATED: tl.constexpr, SCALES: tl.constexpr):
    """(acc, acc_up) [BLOCK_N, BLOCK_T] times each row's scale when SCALES is 1 (one a row;
    the up rows' scales follow the gate rows'): applied once to the finished sums."""
    if SCALES == 1:
        acc = acc * tl.load(s_ptr + rows * ss, mask=rmask, other=0.0)[:, None]
        if GATED:
            acc_up = acc_up * tl.load(s_ptr + (N + rows) * ss, mask=rmask, other=0.0)[:, None]
    return acc, acc_up


@triton.jit
def _w_tiles(w_ptr, up_ptr, rows, rmask, cols, kmask, sw, swk, w_desc, k_at, N, GATED: tl.constexpr,
             TMA: tl.constexpr):
    """W[rows, cols] (and the up rows' tile when GATED) in the weight's dtype. With TMA the
    descriptor w_desc (`tma_descriptor`) reads the box at column k_at (cols[0]'s, counted
    from the weight's first column) and row rows[0] (N + rows[0] for the up rows), rows
    being the program's block (program_id(0) * BLOCK_N on): zeros past the weight's
    edges, and columns past this program's part of K meet zeros in x (`_x_tile`'s mask)."""
    if TMA:
        row0 = tl.program_id(0) * rows.shape[0]
        w = w_desc.load([row0, k_at])
        wu = w
        if GATED:
            wu = w_desc.load([N + row0, k_at])
    else:
        offs = rows[:, None].to(tl.int64) * sw + cols[None, :] * swk
        wmask = rmask[:, None] & kmask[None, :]
        w = tl.load(w_ptr + offs, mask=wmask, other=0.0)
        wu = w
        if GATED:
            wu = tl.load(up_ptr + offs, mask=wmask, other=0.0)
    return w, wu


@triton.jit
def _sum_squares(x, ss, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """ss [BLOCK_N, BLOCK_T] += every token's sum of x^2 over this tile, in each of the
    BLOCK_N rows: a dot of ones with x^2 (x [BLOCK_T, BLOCK_K] fp32), so the sums come out
    in the accumulator's layout. A row reduction (tl.sum) instead, and its conversion to
    that layout, would cost a narrow half layer more than its whole product. The dot is
    fp32 (TF32 products: fp32's range, where half x^2 would overflow fp16 past |x| = 256).
    float32 models take row sums (`product`): TF32's 10-bit products would cost their
    norm its precision."""
    xsq = tl.trans(x * x)
    return tl.dot(tl.full([BLOCK_N, BLOCK_K], 1.0, tl.float32), xsq, ss, input_precision="tf32")


@triton.jit
def first_tiles(w_ptr, nw_ptr, rows, rmask, N, K, sw, swk, w_desc, k_lo, NORM: tl.constexpr, GATED: tl.constexpr,
                BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    """(w, wu, g): the first K tile of W[rows] (of the up rows too when GATED) and of the
    norm's weight. No earlier kernel writes them, so a kernel fetches them before its PDL
    wait and they are on their way while the kernel before it finishes."""
    cols = tl.arange(0, BLOCK_K)
    if TMA:  # `product`'s loop fetches every tile, pipelined: nothing is hoisted
        w = tl.zeros([16, 16], dtype=tl.float32)
        wu = w
    else:
        w, wu = _w_tiles(w_ptr, w_ptr + N.to(tl.int64) * sw, rows, rmask, cols, cols < K, sw, swk, w_desc, k_lo, N,
                         GATED, TMA)
    return w, wu, _norm_weight(nw_ptr, cols, cols < K, NORM)


@triton.jit
def product(x_ptr, w_ptr, nw_ptr, w, wu, g, rows, rmask, T, N, K, sx, sw, swk, eps, w_desc, k_lo, s_ptr, sst,
            GROUP, NORM: tl.constexpr, DEFER: tl.constexpr, GATED: tl.constexpr, HALF: tl.constexpr,
            F32: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            ONE_TILE: tl.constexpr, TMA: tl.constexpr, SCALES: tl.constexpr):
    """(acc, acc_up, ss) fp32 [BLOCK_N, BLOCK_T]: acc[n, t] = W[rows[n]] . norm(x[t]) (acc_up
    the same for the up rows, which follow the gate rows, when GATED; else acc again),
    from `first_tiles`' (w, wu, g); called past the PDL wait (x is an earlier kernel's).
    A deferred norm is not applied yet: `ss` holds the sums of squares that
    `deferred_norm` scales by, once a split K's parts are summed (`split_sum`). On the
    TMA path (`use_tma`) the loop fetches every tile, the first too, and the pipeliner
    keeps the stages' boxes in flight.

    The norm, when NORM, is one of two forms. Exact (DEFER off; one tile only): x is
    normalised as norm.py rounds it, then multiplied. Deferred: the dots take x scaled by
    the norm's weight alone, the same tiles give the sums of squares (`_sum_squares`), and
    the products are scaled by rsqrt(mean(x^2) + eps) at the end: no pass of its own over
    x and no fp32 tile of all K held for it (rounded once at x * weight, not at x * rstd too).

    An fp8 weight (SCALES 1 or 2, `_dot_operand`) meets x in fp16 (half x; `_dot_x`) or
    float32; its row scales
    (SCALES 1) are left to `row_scaled`, its block scales (SCALES 2, at s_ptr [N, groups],
    row stride sst, GROUP columns each) multiply each tile."""
    tl.static_assert(ONE_TILE or DEFER or not NORM)
    tl.static_assert(not (TMA and ONE_TILE))
    toks = tl.arange(0, BLOCK_T)
    tmask = toks < T
    up_ptr = w_ptr + N.to(tl.int64) * sw  # GATED: the up rows follow the gate rows
    cols = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    dot_ty = w_ptr.dtype.element_ty
    if SCALES > 0:  # fp8 widens to fp16 in one instruction, to bf16 only through fp32
        dot_ty = tl.float16 if HALF else dtype
    up_s = s_ptr + N * sst  # GATED: the up rows' scales
    ones = tl.full([BLOCK_T], 1.0, dtype=tl.float32)
    ss = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    ss_rows = tl.zeros([BLOCK_T], dtype=tl.float32)  # TMA, F32: the sums of squares as row sums
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    acc_up = acc  # unused unless GATED
    start = 0
    if not TMA:  # the first tile, w and wu fetched before the PDL wait
        x = _x_tile(x_ptr, toks, tmask, cols, cols < K, sx)
        rstd = ones
        if NORM and not DEFER:  # the whole row is this tile
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / K + eps)
        if NORM and DEFER:
            if F32:
                ss_rows += tl.sum(x * x, axis=1)
            else:
                ss = _sum_squares(x, ss, BLOCK_N, BLOCK_K)
        xt = tl.trans(_dot_x(_normed(x, g, rstd, NORM, HALF, dtype), dot_ty, SCALES))
        kmask = cols < K
        w = _dot_operand(w, s_ptr, rows, rmask, k_lo + cols, kmask, sst, GROUP, SCALES, dot_ty)
        acc = _dot(w, xt, acc, F32)
        if GATED:
            wu = _dot_operand(wu, up_s, rows, rmask, k_lo + cols, kmask, sst, GROUP, SCALES, dot_ty)
            acc_up = _dot(wu, xt, tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32), F32)
        start = BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        kcols = k0 + cols
        kmask = kcols < K
        x = _x_tile(x_ptr, toks, tmask, kcols, kmask, sx)
        if NORM:
            if TMA or F32:  # one row sum a tile: the dot form's ones tile costs a wide layer
                ss_rows += tl.sum(x * x, axis=1)  # more than it saves, and a float32 one its precision
            else:
                ss = _sum_squares(x, ss, BLOCK_N, BLOCK_K)
        g = _norm_weight(nw_ptr, kcols, kmask, NORM)
        xt = tl.trans(_dot_x(_normed(x, g, ones, NORM, HALF, dtype), dot_ty, SCALES))
        wt, wut = _w_tiles(w_ptr, up_ptr, rows, rmask, kcols, kmask, sw, swk, w_desc, k_lo + k0, N, GATED, TMA)
        wt = _dot_operand(wt, s_ptr, rows, rmask, k_lo + kcols, kmask, sst, GROUP, SCALES, dot_ty)
        acc = _dot(wt, xt, acc, F32)
        if GATED:
            wut = _dot_operand(wut, up_s, rows, rmask, k_lo + kcols, kmask, sst, GROUP, SCALES, dot_ty)
            acc_up = _dot(wut, xt, acc_up, F32)
    if TMA or F32:
        ss += ss_rows[None, :]
    return acc, acc_up, ss


@triton.jit
def deferred_norm(acc, acc_up, ss, K, eps, NORM: tl.constexpr, DEFER: tl.constexpr):
    """`product`'s (acc, acc_up) scaled by rsqrt(mean(x^2) + eps) when the norm is deferred
    (ss: the sums of squares over all K columns, [BLOCK_N, BLOCK_T], every row the same)."""
    if NORM and DEFER:
        scale = tl.rsqrt(ss / K + eps)
        acc = acc * scale
        acc_up = acc_up * scale
    return acc, acc_up


@triton.jit
def split_range(K, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """(first column, columns) of this program's part of K (program axis 1): SPLIT_K parts
    of whole BLOCK_K tiles; a part past K has none (its products are zeros)."""
    chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = tl.program_id(1) * chunk
    return k_lo, tl.minimum(chunk, K - k_lo)


@triton.jit
def split_sum(part_ptr, count_ptr, acc, acc_up, ss, GATED: tl.constexpr, NORM: tl.constexpr,
              SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """(acc, acc_up, ss, last) summed over the SPLIT_K programs of this row block (program
    axis 0), in the last of them to arrive (`last`; the others' sums are not).

    Each program stores its fp32 parts at part_ptr [row blocks, SPLIT_K, 3, BLOCK_N,
    BLOCK_T] and counts itself in on count_ptr[row block]; the one that counts SPLIT_K
    sums the parts in split order, whoever came last, so the result does not depend on
    the programs' timing, and sets the count back to 0 for the next launch (launches on
    one stream never overlap: a later kernel's PDL wait waits for this one to finish).
    The barrier puts every thread's stores before the counting atomic (acq_rel, GPU
    scope), and the sums are read past L1 (.cg), which another SM's writes do not reach."""
    tile: tl.constexpr = BLOCK_N * BLOCK_T
    offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
    base = part_ptr + tl.program_id(0).to(tl.int64) * (SPLIT_K * 3 * tile)
    mine = base + tl.program_id(1) * (3 * tile)
    tl.store(mine + offs, acc)
    if GATED:
        tl.store(mine + tile + offs, acc_up)
    if NORM:
        tl.store(mine + 2 * tile + offs, ss)
    tl.debug_barrier()
    last = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel") == SPLIT_K - 1
    if last:
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        acc_up = acc
        ss = acc
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(base + s * (3 * tile) + offs, cache_modifier=".cg")
            if GATED:
                acc_up += tl.load(base + s * (3 * tile) + tile + offs, cache_modifier=".cg")
            if NORM:
                ss += tl.load(base + s * (3 * tile) + 2 * tile + offs, cache_modifier=".cg")
        tl.store(count_ptr + tl.program_id(0), 0)
    return acc, acc_up, ss, last


@triton.jit
def _store_out(acc, acc_up, out_ptr, res_ptr, rows, rmask, T, so, sr, RES: tl.constexpr, GATED: tl.constexpr,
               DTYPE: tl.constexpr, BLOCK_T: tl.constexpr):
    """out[t, rows] = the products rounded as F.linear's output is (acc[n, t] is token t's
    output n), through SiLU*mul when GATED, plus the residual when RES."""
    toks = tl.arange(0, BLOCK_T)
    tmask = toks < T
    y = acc.to(DTYPE).to(tl.float32)
    if GATED:  # activation.py: silu rounded, then the product
        up = acc_up.to(DTYPE).to(tl.float32)
        y = (y / (1.0 + tl.exp(-y))).to(DTYPE).to(tl.float32) * up
    omask = rmask[:, None] & tmask[None, :]
    if RES:
        y = tl.load(res_ptr + toks[None, :] * sr + rows[:, None], mask=omask, other=0.0).to(tl.float32) + y
    tl.store(out_ptr + toks[None, :] * so + rows[:, None], y.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, w_desc, s_ptr, out_ptr, res_ptr, nw_ptr, part_ptr, count_ptr, T, N, K, sx, sw, swk,
                   ss, GROUP, so, sr, eps, SCALES: tl.constexpr, NORM: tl.constexpr,
                   DEFER: tl.constexpr, RES: tl.constexpr, GATED: tl.constexpr,
                   HALF: tl.constexpr, F32: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr, SPLIT_K: tl.constexpr, TMA: tl.constexpr,
                   PREFETCH: tl.constexpr, USE_PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    k_lo, k_len = split_range(K, SPLIT_K, BLOCK_K)  # the whole K without a split
    xk, wk, nwk = x_ptr + k_lo, w_ptr + k_lo * swk, nw_ptr + k_lo
    w, wu, g = first_tiles(wk, nwk, rows, rmask, N, k_len, sw, swk, w_desc, k_lo, NORM, GATED, BLOCK_K, TMA)
    if PREFETCH:  # the loop's later tiles: this program's rows are one contiguous block (swk 1, sw K)
        row0 = tl.program_id(0) * BLOCK_N
        n_el = tl.minimum(BLOCK_N, N - row0) * sw
        prefetch_l2(w_ptr + row0.to(tl.int64) * sw, n_el, 128, PREFETCH)
        if GATED:
            prefetch_l2(w_ptr + (N + row0).to(tl.int64) * sw, n_el, 128, PREFETCH)
    wait_and_release(USE_PDL)  # past this, every earlier kernel's writes (x, residual) are visible
    acc, acc_up, sq = product(xk, wk, nwk, w, wu, g, rows, rmask, T, N, k_len, sx, sw, swk, eps, w_desc, k_lo, s_ptr,
                              ss, GROUP, NORM, DEFER, GATED, HALF, F32, BLOCK_T, BLOCK_N, BLOCK_K, ONE_TILE, TMA,
                              SCALES)
    last = True
    if SPLIT_K > 1:
        tl.static_assert(DEFER or not NORM)  # the exact norm needs the whole row in one program
        acc, acc_up, sq, last = split_sum(part_ptr, count_ptr, acc, acc_up, sq, GATED, NORM, SPLIT_K, BLOCK_N,
                                          BLOCK_T)
    if last:
        acc, acc_up = deferred_norm(acc, acc_up, sq, K, eps, NORM, DEFER)
        acc, acc_up = row_scaled(acc, acc_up, s_ptr, rows, rmask, N, ss, GATED, SCALES)
        _store_out(acc, acc_up, out_ptr, res_ptr, rows, rmask, T, so, sr, RES, GATED, x_ptr.dtype.element_ty,
                   BLOCK_T)


def skinny(x: torch.Tensor, weight: torch.Tensor | QuantWeight, *, norm_weight: torch.Tensor | None = None,
           eps: float = 0.0, residual: torch.Tensor | None = None, gated: bool = False,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, K] (T <= MAX_TOKENS) times weight [N, K] -> [T, N]; `matvec.gemv`'s contract
    for T tokens (gated: weight [2N, K] -> [T, N]), fp8 weights included."""
    weight, scale, group = unpack(weight)
    t, k = x.shape
    assert 1 <= t <= MAX_TOKENS and weight.dim() == 2 and weight.shape[1] == k, (x.shape, weight.shape)
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(t, n, dtype=out_dtype or x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == (t, n) and residual.dtype == x.dtype, (residual.shape, residual.dtype)
        if residual.stride(1) != 1:  # rows read at residual.stride(0): 0 broadcasts one row (a bias)
            residual = residual.contiguous()
    norm = norm_weight is not None
    assert norm_weight is None or norm_weight.shape == (k,), norm_weight.shape
    block_t = 16 if t <= 16 else 32
    tma = use_tma(weight)
    if tma:
        cfg = _tma_config(n, k, gated, norm, tile_bytes(x, weight), block_t, x.device, fp8=scale is not None)
    else:
        cfg = _config(n, k, gated, norm, tile_bytes(x, weight), block_t, x.device)
    grid_n = triton.cdiv(n, cfg.block_n)
    part, counts = split_buffers(x.device, grid_n, cfg, block_t)
    key = (n, k, gated, norm, block_t, residual is not None, tma, x.dtype, weight.dtype, out.dtype)
    stages = _FITTED.get(key, cfg.stages)
    while True:
        try:
            _skinny_kernel[(grid_n, cfg.split)](
                x, weight, tma_descriptor(weight, cfg) if tma else weight, scale if scale is not None else x, out,
                residual if residual is not None else out, norm_weight if norm else x, part, counts, t, n, k,
                x.stride(0), weight.stride(0), weight.stride(1), scale.stride(0) if scale is not None else 0, group,
                out.stride(0), residual.stride(0) if residual is not None else 0, eps,
                SCALES=scale_mode(scale, group, k), RES=residual is not None, GATED=gated,
                BLOCK_N=cfg.block_n, num_warps=cfg.warps, num_stages=stages, SPLIT_K=cfg.split, TMA=tma,
                PREFETCH=prefetch_step(weight, cfg.block_k, cfg.split, tma),
                **product_flags(x, norm, k, block_t, cfg.block_k, cfg.split, tma), **pdl_flags(x.device))
            return out
        except OutOfResources:
            # `_config` counts one weight and one x tile a stage; some variants' pipelines hold
            # more than that, which only the compiler knows: retry with one stage fewer
            if stages == 1:
                raise
            stages = _FITTED[key] = stages - 1


# Launch shapes whose configured stages did not fit the device: the stages that did
_FITTED: dict[tuple, int] = {}


def scale_mode(scale: torch.Tensor | None, group: int, k: int) -> int:
    """`product`'s SCALES: 0 a float weight, 1 fp8 with one scale a row, 2 fp8 with block scales."""
    return 0 if scale is None else 1 if group >= k else 2


def tile_bytes(x: torch.Tensor, weight: torch.Tensor) -> int:
    """Bytes an element of a weight tile takes once it meets x in tl.dot: an fp8 tile is
    sized as the activations' dtype: its tiles have the same shapes as a half weight's."""
    return x.element_size() if weight.element_size() == 1 else weight.element_size()


TMA_OVERRIDE: bool | None = None  # tests: force the descriptor path on (the interpreter runs it) or off


def use_tma(weight: torch.Tensor) -> bool:
    """Whether `weight` streams through a TMA descriptor (`tma_descriptor`) rather than
    pointer loads: on Hopper or later (`kernels.tma_enabled`), for weights wider and taller
    than kernels.SKINNY_MAX_WIDTH (where pointer loads fall behind cuBLAS), rows contiguous
    and 16-byte aligned; not float32 weights (`kernels.use_gemv` leaves such layers to cuBLAS)."""
    if TMA_OVERRIDE is not None:
        return TMA_OVERRIDE
    n, k = weight.shape
    return (n > SKINNY_MAX_WIDTH and k > SKINNY_MAX_WIDTH and weight.element_size() < 4
            and tma_enabled(weight.device) and weight.stride(1) == 1
            and weight.stride(0) * weight.element_size() % 16 == 0 and weight.data_ptr() % 16 == 0)


def tma_descriptor(weight: torch.Tensor, cfg: Config) -> TensorDescriptor:
    """The TMA descriptor of weight [N, K] in boxes of cfg's BLOCK_N rows by BLOCK_K columns
    (a host-side CUtensorMap passed by value: CUDA graphs keep it). Built each call: a cache
    would hold freed weights alive; it costs a few microseconds of host time an eager call."""
    return TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])


def product_flags(x: torch.Tensor, norm: bool, k: int, block_t: int, block_k: int, split: int = 1,
                  tma: bool = False) -> dict:
    """`product`'s constexprs for activations x [T, k] and a K tile of block_k. The norm
    is deferred but for one tile of up to 16 tokens, where the exact form is faster (the
    whole row is in registers: no sums of squares to carry); a K split across programs
    and the TMA path (`use_tma`) always defer it."""
    one_tile = block_k >= k and split == 1 and not tma
    return dict(NORM=norm, DEFER=norm and not (one_tile and block_t == 16), HALF=x.dtype in _HALF,
                F32=x.dtype == torch.float32, BLOCK_T=block_t, BLOCK_K=block_k, ONE_TILE=one_tile)
