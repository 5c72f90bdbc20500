"""The batch-invariant linear layer of `--enable-deterministic-inference`: y = x W^T (+ b).

Invariant: row i of a call over M rows equals, bit for bit, the call over that row alone,
for every M. A row's arithmetic is fixed by the weight's shape and the dtypes only:
  * tiles of BLOCK_M = 16 rows for every M (a decode step pads its one row to 16): M
    only sets how many row tiles the grid has, never a tile's shape;
  * BLOCK_N and BLOCK_K come from (N, K) alone (`config`), and so does whether K is
    split, one K tile a split (`split_k`: a weight too narrow to fill the GPU). Without
    splits one program sums all of a row's K columns, BLOCK_K at a time, in order, into
    one fp32 accumulator through tl.dot. With splits each K tile's dot is summed from
    zero on its own and added to the output's accumulator, from zero, in K order: a call
    of up to SPLIT_ROWS rows gives each tile a program (its weight tile fetched before
    the PDL wait) that stores its sum, and the last of them to arrive adds the stored
    sums in order (`_split_sum`); a longer call walks the tiles in one program
    (`_walk`). Both are the same fp32 operations in the same order, so the bits
    are too;
  * M is not specialised on (`do_not_specialize`), so one compiled kernel serves all M
    (three on a GPU: a few-row call's walking programs may first ask L2 for their short
    weight rows, `prefetch_rule`, or release the next kernel after their K loop over long
    ones, `release_late`; neither touches the arithmetic).
cuBLAS chooses its kernel (tile, split-K, stream-K) from M, which is why a verify of N
tokens and a decode of one round the same row differently there.

The few-token GEMVs (`matvec.py`, `skinny.py`) pick their tiles and splits from the token
count too, so the mode does not use them. Instead this kernel takes the layer's row-local
neighbours into its epilogue, each a function of the row alone (nothing transforms x
between its load and the dot: that breaks the loads' pipelining and costs more than the
launches it saves):
  * `norm`, a pre-norm (RMSNorm): the caller folds the norm's weight into `weight` once
    (W diag(w), models/invariant.py); the row's 1/rms arrives as partial sums of squares
    ([M, S] float32, summed here in index order, so no program passes over the row) and
    scales the accumulator;
  * `gated`: the weight is gate_up [2N, K]; a program keeps the gate's and the up's tiles
    of the same columns, as wide as the whole weight's (`plan`: 64 rows each for an 8B
    model's MLP, in two stages), and writes silu(gate) * up, rounded as gate_up followed
    by kernels/activation.py would round them;
  * `residual`: y = residual + x W^T, rounded as torch's `residual + y`; with `sumsq` it
    also returns each output tile's sum of squares of y, the partial sums the next
    layer's norm reads.
`row_sumsq` gives the same partial sums for a stream that no such epilogue wrote (the
embedding's). fp8 weights (`scale`): each tile is widened to x's dtype (exact: e4m3 fits
bf16 and fp16) before its dot, and the fp32 sums are scaled by the row's scale at the end,
or tile by tile by the scale of the group of columns the tile lies in (BLOCK_K then at most
the group; `fp8_scales_served`). float32 models get IEEE fp32 products (no TF32). Weights are [N, K], any
strides (unit column stride on GPUs, where a stride of 1 compiles as a constant; the CPU's
transposed layout under the interpreter).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from specserve.core.quant import QuantWeight
from specserve.kernels import pdl_flags
from specserve.kernels.pdl import L2_PREFETCH, prefetch_l2, release_dependents, wait_and_release, wait_for_inputs
from specserve.kernels.pdl import prefetch_rule as gemv_prefetch_rule
from specserve.kernels.skinny_config import counts

BLOCK_M = 16
SUMSQ_GROUP = 32  # columns per partial sum of squares from `row_sumsq`
SPLIT_TILES = 24  # a weight of fewer output tiles has its K split (`split_k`)
SPLIT_TILES_LONG = 65  # ... and one of rows of PREFETCH_K columns or more, fewer than this
SPLIT_ROWS = 4 * BLOCK_M  # a call of at most this many rows gives each of a split weight's K tiles a program
PREFETCH_K = 1024  # a walking program of a few-row call asks L2 for rows shorter than this (`prefetch_rule`)


@triton.jit
def _w_tile(w_ptr, rows, ks, sw, swk, mask):
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * sw + ks[None, :] * swk, mask=mask, other=0.0)


@triton.jit
def _group_scales(s_ptr, rows, nmask, k0, ssc, SCALE: tl.constexpr, GROUP: tl.constexpr):
    """The scales of the weight rows `rows` for the group holding column k0 (SCALE 2), else 1."""
    if SCALE == 2:
        return tl.load(s_ptr + rows.to(tl.int64) * ssc + k0 // GROUP, mask=nmask, other=0.0)
    return tl.full(rows.shape, 1.0, tl.float32)


@triton.jit
def _dot_tile(x, w, s, acc, PREC: tl.constexpr, SCALE: tl.constexpr):
    """acc + x times the weight tile w; fp8 weights (SCALE) widened to x's dtype (exactly),
    and with scales on groups of columns (SCALE 2) the tile's dot scaled by its group's `s`
    before it is added."""
    if SCALE == 0:
        return tl.dot(x, tl.trans(w), acc, input_precision=PREC)
    w = w.to(x.dtype)
    if SCALE == 1:
        return tl.dot(x, tl.trans(w), acc, input_precision=PREC)
    return acc + tl.dot(x, tl.trans(w), input_precision=PREC) * s[None, :]


@triton.jit
def _product(x, w_ptr, s_ptr, acc, rows, nmask, ks, kmask, k0, sw, swk, ssc, PREC: tl.constexpr,
             SCALE: tl.constexpr, GROUP: tl.constexpr):
    """`_dot_tile` of the weight rows `rows` at columns ks, loaded here."""
    w = _w_tile(w_ptr, rows, ks, sw, swk, nmask[:, None] & kmask[None, :])
    return _dot_tile(x, w, _group_scales(s_ptr, rows, nmask, k0, ssc, SCALE, GROUP), acc, PREC, SCALE)


@triton.jit
def _split_sum(part_ptr, count_ptr, acc, acc_up, rows, cols, mask, M, N, GATED: tl.constexpr,
               SPLITS: tl.constexpr):
    """(acc, acc_up, last): the SPLITS programs of this output tile (program axis 2) store
    their sums at part_ptr [SPLITS, M, N or 2N] and count themselves in on the device's
    counts (skinny_config.counts); the one that counts SPLITS adds the stored sums in split
    order from zero, whoever came last, and sets the count back to 0 for the next launch
    (`last`; the others' sums are not the output's). The barrier puts every thread's stores
    before the counting atomic (acq_rel, GPU scope); the sums are read past L1 (.cg)."""
    width = 2 * N if GATED else N
    at = rows[:, None].to(tl.int64) * width + cols[None, :]
    mine = part_ptr + tl.program_id(2).to(tl.int64) * M * width
    tl.store(mine + at, acc, mask=mask)
    if GATED:
        tl.store(mine + N + at, acc_up, mask=mask)
    tl.debug_barrier()
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    last = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLITS - 1
    if last:
        acc = tl.zeros(acc.shape, dtype=tl.float32)
        acc_up = tl.zeros(acc.shape, dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            theirs = part_ptr + s * M.to(tl.int64) * width
            acc = acc + tl.load(theirs + at, mask=mask, other=0.0, cache_modifier=".cg")
            if GATED:
                acc_up = acc_up + tl.load(theirs + N + at, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(count_ptr + tile, 0)
    return acc, acc_up, last


@triton.jit
def _finished_sums(acc, acc_up, s_ptr, b_ptr, ss_in, rows, rmask, cols, nmask, N, K, ssc, n_ss, eps,
                    SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, S_IN: tl.constexpr,
                    GATED: tl.constexpr):
    """The sums of all of K with what no product holds: an fp8 weight's row scales, the
    norm's 1/rms (from the row's partial sums of squares, in index order) and the bias."""
    if SCALE == 1:  # one scale a row (an fp8 weight's output channel)
        acc *= tl.load(s_ptr + cols.to(tl.int64) * ssc, mask=nmask, other=0.0)[None, :]
        if GATED:
            acc_up *= tl.load(s_ptr + (N + cols).to(tl.int64) * ssc, mask=nmask, other=0.0)[None, :]
    if NORM:
        s = tl.arange(0, S_IN)
        part = tl.load(ss_in + rows[:, None].to(tl.int64) * n_ss + s[None, :],
                       mask=rmask[:, None] & (s < n_ss)[None, :], other=0.0)
        rstd = tl.rsqrt(tl.sum(part, axis=1) / K + eps)[:, None]
        acc, acc_up = acc * rstd, acc_up * rstd
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_ptr + N + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
    return acc, acc_up


@triton.jit
def _epilogue(acc, acc_up, s_ptr, b_ptr, y_ptr, r_ptr, ss_in, ss_out, rows, cols, rmask, nmask, M, N, K, ssc,
              sy, sr, n_ss, eps, dt: tl.constexpr, SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
              NORM: tl.constexpr, S_IN: tl.constexpr, GATED: tl.constexpr, RES: tl.constexpr,
              SS_OUT: tl.constexpr):
    """The output tile from the whole of K's sums (`_finished_sums`), then SiLU*mul and
    the residual as the module docstring rounds them, the store (and sums of squares)."""
    acc, acc_up = _finished_sums(acc, acc_up, s_ptr, b_ptr, ss_in, rows, rmask, cols, nmask, N, K, ssc, n_ss, eps,
                                  SCALE, HAS_BIAS, NORM, S_IN, GATED)
    if GATED:  # gate_up rounded to x's dtype, then F.silu's rounding, then the product
        g = acc.to(dt).to(tl.float32)
        acc = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * acc_up.to(dt).to(tl.float32)
    mask = rmask[:, None] & nmask[None, :]
    if RES:  # rounded as torch's `residual + y`, both in the stream's dtype
        r = tl.load(r_ptr + rows[:, None].to(tl.int64) * sr + cols[None, :], mask=mask, other=0.0)
        acc = acc.to(dt).to(tl.float32) + r.to(tl.float32)
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * sy + cols[None, :], y, mask=mask)
    if SS_OUT:
        yf = tl.where(mask, y.to(tl.float32), 0.0)
        tl.store(ss_out + rows.to(tl.int64) * tl.num_programs(1) + tl.program_id(1), tl.sum(yf * yf, axis=1),
                 mask=rmask)


@triton.jit
def _x_tile(x_ptr, rows, rmask, ks, kmask, sx):
    return tl.load(x_ptr + rows[:, None].to(tl.int64) * sx + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                   other=0.0)


@triton.jit
def _walk(x_ptr, w_ptr, s_ptr, rows, rmask, cols, nmask, N, K, sx, sw, swk, ssc, zero, PREC: tl.constexpr,
          SCALE: tl.constexpr, GROUP: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PREFETCH: tl.constexpr,
          LATE: tl.constexpr, USE_PDL: tl.constexpr):
    """(acc, acc_up): all of K in one program, tile after tile. Without splits the tiles'
    dots accumulate into one accumulator; a split weight's (SPLIT_K) each start from `zero`
    (0.0 at runtime: from a constant the compiler would fold the tile's dot into the
    accumulator's) and are added to the accumulator in order, `_one_split`'s arithmetic.
    With PREFETCH (elements a 128-byte line) the program first asks L2 for its weight rows,
    one contiguous block, before the PDL wait (no earlier kernel writes the weight); with
    LATE it lets the next kernel launch only after its K loop (`release_late`)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    z = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) + zero
    if PREFETCH:
        row0 = tl.program_id(1) * BLOCK_N
        n_el = tl.minimum(BLOCK_N, N - row0) * sw
        prefetch_l2(w_ptr + row0.to(tl.int64) * sw, n_el, 128, PREFETCH)
        if GATED:
            prefetch_l2(w_ptr + (N + row0).to(tl.int64) * sw, n_el, 128, PREFETCH)
    wait_for_inputs(USE_PDL)
    if not LATE:
        release_dependents(USE_PDL)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        x = _x_tile(x_ptr, rows, rmask, ks, kmask, sx)
        if SPLIT_K:
            acc = acc + _product(x, w_ptr, s_ptr, z, cols, nmask, ks, kmask, k0, sw, swk, ssc, PREC, SCALE, GROUP)
            if GATED:
                acc_up = acc_up + _product(x, w_ptr, s_ptr, z, N + cols, nmask, ks, kmask, k0, sw, swk, ssc, PREC,
                                           SCALE, GROUP)
        else:
            acc = _product(x, w_ptr, s_ptr, acc, cols, nmask, ks, kmask, k0, sw, swk, ssc, PREC, SCALE, GROUP)
            if GATED:
                acc_up = _product(x, w_ptr, s_ptr, acc_up, N + cols, nmask, ks, kmask, k0, sw, swk, ssc, PREC,
                                  SCALE, GROUP)
    if LATE:
        release_dependents(USE_PDL)
    return acc, acc_up


@triton.jit
def _one_split(x_ptr, w_ptr, s_ptr, rows, rmask, cols, nmask, N, K, sx, sw, swk, ssc, PREC: tl.constexpr,
               SCALE: tl.constexpr, GROUP: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """(acc, acc_up): the one K tile of this program's split (program axis 2), its weight
    (and scales) fetched before the PDL wait: no earlier kernel writes them, so only x's
    tile is left on the chain of dependent launches. The tile's dot is summed from zero and
    added to a zero accumulator, as `_walk` adds each of a split weight's tiles."""
    k0 = tl.program_id(2) * BLOCK_K
    ks = k0 + tl.arange(0, BLOCK_K)
    kmask = ks < K
    w = _w_tile(w_ptr, cols, ks, sw, swk, nmask[:, None] & kmask[None, :])
    s = _group_scales(s_ptr, cols, nmask, k0, ssc, SCALE, GROUP)
    if GATED:
        wu = _w_tile(w_ptr, N + cols, ks, sw, swk, nmask[:, None] & kmask[None, :])
        su = _group_scales(s_ptr, N + cols, nmask, k0, ssc, SCALE, GROUP)
    wait_and_release(USE_PDL)
    x = _x_tile(x_ptr, rows, rmask, ks, kmask, sx)
    zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = zero + _dot_tile(x, w, s, zero, PREC, SCALE)
    acc_up = zero
    if GATED:
        acc_up = zero + _dot_tile(x, wu, su, zero, PREC, SCALE)
    return acc, acc_up


@triton.jit(do_not_specialize=["M", "zero"])
def _invariant_mm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, r_ptr, ss_in, ss_out, part_ptr, count_ptr, M, N, K, sx,
                         sw, swk, ssc, sy, sr, n_ss, eps, zero, SCALE: tl.constexpr, GROUP: tl.constexpr,
                         HAS_BIAS: tl.constexpr, NORM: tl.constexpr, S_IN: tl.constexpr, GATED: tl.constexpr,
                         RES: tl.constexpr, SS_OUT: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, SPLITS: tl.constexpr,
                         PREFETCH: tl.constexpr, LATE: tl.constexpr, USE_PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, nmask = rows < M, cols < N
    if SPLITS > 1:  # one K tile a program (`split_k`)
        acc, acc_up = _one_split(x_ptr, w_ptr, s_ptr, rows, rmask, cols, nmask, N, K, sx, sw, swk, ssc, PREC, SCALE,
                                 GROUP, GATED, BLOCK_M, BLOCK_N, BLOCK_K, USE_PDL)
    else:
        acc, acc_up = _walk(x_ptr, w_ptr, s_ptr, rows, rmask, cols, nmask, N, K, sx, sw, swk, ssc, zero, PREC,
                            SCALE, GROUP, GATED, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, PREFETCH, LATE, USE_PDL)
    last = True
    if SPLITS > 1:
        acc, acc_up, last = _split_sum(part_ptr, count_ptr, acc, acc_up, rows, cols, rmask[:, None] & nmask[None, :],
                                       M, N, GATED, SPLITS)
    if last:
        _epilogue(acc, acc_up, s_ptr, b_ptr, y_ptr, r_ptr, ss_in, ss_out, rows, cols, rmask, nmask, M, N, K, ssc,
                  sy, sr, n_ss, eps, x_ptr.dtype.element_ty, SCALE, HAS_BIAS, NORM, S_IN, GATED, RES, SS_OUT)


@triton.jit
def _row_sumsq_kernel(x_ptr, ss_ptr, N, sx, n_ss, S: tl.constexpr, GROUP: tl.constexpr, USE_PDL: tl.constexpr):
    wait_and_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, S)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    x = tl.load(x_ptr + row * sx + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(ss_ptr + row * n_ss + g, tl.sum(x * x, axis=1), mask=g < n_ss)


def config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of a weight [n, k]: a function of the
    weight alone, chosen by a sweep at one row (docs/benchmarks.md): wide outputs (an
    lm_head) take 64-row weight tiles, the rest 32 so that narrow layers still spread
    over enough programs; longer rows take longer K tiles."""
    block_k = 128 if k < 1024 else 256 if k <= 4096 else 512
    return (64 if n >= 16384 else 32), min(block_k, max(16, triton.next_power_of_2(k))), 4, (4 if block_k <= 256 else 3)


class Plan(NamedTuple):
    """A call's launch: the weight's tiles (`config`), its scales' mode (0 none, 1 a row,
    2 a group of `group` columns), whether its K is split (`split_k`) and the programs a
    split output tile takes (1: one walks them all)."""
    block_n: int
    block_k: int
    warps: int
    stages: int
    mode: int
    group: int
    split: bool
    splits: int


def plan(m: int, n: int, k: int, scale: QuantWeight | None, gated: bool = False) -> Plan:
    """The launch of m rows through weight [n, k] (an fp8 weight's `scale`), or through a
    gate_up [2n, k] (`gated`), which takes the whole weight's tiles (`config(2n, k)`):
    where those are 64 rows wide, each stage holds a gate and an up tile, so it keeps
    two stages."""
    block_n, block_k, warps, stages = config(2 * n if gated else n, k)
    if gated and block_n == 64:
        stages = 2
    mode, group = 0, 1
    if scale is not None and scale.group >= k:
        mode = 1
    elif scale is not None:
        mode, group = 2, scale.group
        block_k = min(block_k, group)  # a K tile inside one scale group
    split = split_k(n, k, block_n)
    splits = triton.cdiv(k, block_k) if split and m <= SPLIT_ROWS else 1
    return Plan(block_n, block_k, warps, stages, mode, group, split, splits)


def prefetch(weight: torch.Tensor, p: Plan, m: int) -> int:
    """The PREFETCH constexpr of a call of m rows through `weight` on plan p (`prefetch_rule`):
    0 off a GPU, where no inline asm runs, and with SPECSERVE_L2_PREFETCH=0."""
    if not (weight.is_cuda and L2_PREFETCH):
        return 0
    return prefetch_rule((weight.shape[0], weight.shape[1]), (weight.stride(0), weight.stride(1)),
                         weight.element_size(), p, m)


def prefetch_rule(shape: tuple[int, int], strides: tuple[int, int], w_bytes: int, p: Plan, m: int) -> int:
    """Elements a 128-byte line when a walking program of a call of m rows asks L2 for its
    whole weight rows before the PDL wait (`pdl.prefetch_l2`), else 0: for rows shorter than
    PREFETCH_K (a small model's qkv and gate_up) in a few-row call (a decode or a verify, at
    most SPLIT_ROWS), where `pdl.prefetch_rule` takes the weight (a contiguous one, not an
    lm_head). Longer rows were slower asking for their first tiles, and for all of them
    (docs/benchmarks.md)."""
    few_short = shape[1] < PREFETCH_K and m <= SPLIT_ROWS and p.splits == 1
    return gemv_prefetch_rule(shape, strides, w_bytes, p.block_k, 1, False) if few_short else 0


def release_late(p: Plan, m: int, k: int) -> bool:
    """Whether the walking programs of a call of m rows let the next kernel launch only
    after their K loop (the LATE constexpr) rather than at their PDL wait: in a few-row
    call (a decode or a verify, at most SPLIT_ROWS) over rows of PREFETCH_K columns or more,
    which take no prefetch. Such calls ran faster releasing late, the short rows' slower
    (docs/benchmarks.md)."""
    return p.splits == 1 and k >= PREFETCH_K and m <= SPLIT_ROWS


def split_parts(p: Plan, m: int, width: int, device: torch.device) -> torch.Tensor:
    """`_split_sum`'s fp32 scratch for m rows of `width` sums a split ([splits, m, width]);
    without split programs the device's counts (never dereferenced: no allocation a call)."""
    if p.splits == 1:
        return counts(device)
    return torch.empty(p.splits * m * width, dtype=torch.float32, device=device)


def split_k(n: int, k: int, block_n: int) -> bool:
    """Whether weight [n, k]'s K is split, one K tile a split: a function of the weight
    alone, true for one of fewer than SPLIT_TILES output tiles (too narrow to fill a GPU at
    one row: each of its K tiles can have a program), or of fewer than SPLIT_TILES_LONG
    over rows of PREFETCH_K columns or more (a 1.5B model's layers but its MLP's gate_up).
    Splitting wider weights, or narrow ones of short rows, was slower (docs/benchmarks.md)."""
    tiles = triton.cdiv(n, block_n)
    return tiles < SPLIT_TILES or (k >= PREFETCH_K and tiles < SPLIT_TILES_LONG)


def fp8_scales_served(qw: QuantWeight) -> bool:
    """Whether `invariant_matmul` takes this fp8 weight's scales: one a row, or one every
    `group` columns with `group` a power of two of 16 or more (each K tile then inside one)."""
    k = qw.shape[1]
    return qw.method == "fp8" and (qw.group >= k or (qw.group >= 16 and qw.group & (qw.group - 1) == 0))


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None, *, norm: tuple[float, torch.Tensor] | None = None,
                     gated: bool = False, residual: torch.Tensor | None = None, sumsq: bool = False,
                     scale: QuantWeight | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in `out_dtype` (default x's),
    each row computed as the module docstring fixes it, whatever M is. `norm` (eps, the
    partial sums of squares of x's rows [M, S]): x is RMS-normalised first, the norm's
    weight already folded into `weight`; `gated`: weight (and bias) is gate_up [2N, K] and
    the result silu(gate) * up [M, N]; `residual` [M, N] (x's dtype) is added; `sumsq`
    (with a residual): returns (y, the partial sums of squares of y's rows [M, S]).
    `scale`: `weight` is that fp8 weight's data (`fp8_scales_served`)."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    assert not sumsq or residual is not None, "the partial sums come from the residual epilogue"
    assert not (gated and residual is not None), "a gated product takes no residual"
    assert scale is None or fp8_scales_served(scale), (scale.method, scale.group)
    if x.stride(-1) != 1:
        x = x.contiguous()
    (m, k), n = x.shape, weight.shape[0] // (2 if gated else 1)
    block_n, block_k, warps, stages, mode, group, split, splits = p = plan(m, n, k, scale, gated)
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    ss = torch.empty(m, triton.cdiv(n, block_n), dtype=torch.float32, device=x.device) if sumsq else y
    if m == 0:
        return (y, ss) if sumsq else y
    if residual is not None:
        assert residual.shape == (m, n) and residual.dtype == x.dtype and residual.stride(-1) == 1, residual.shape
    eps, ss_in = norm if norm is not None else (0.0, y)
    assert norm is None or (ss_in.shape[0] == m and ss_in.is_contiguous()), ss_in.shape
    n_ss = ss_in.shape[1] if norm is not None else 1
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    # row tiles vary fastest: the programs that read one weight tile run together, so at
    # many rows the weight streams from memory about once (the rest hit L2)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, block_n), splits)
    s = scale.scale if scale is not None else y
    _invariant_mm_kernel[grid](
        x, weight, s, bias if bias is not None else weight, y, residual if residual is not None else y, ss_in, ss,
        split_parts(p, m, n * (2 if gated else 1), x.device), counts(x.device), m, n, k, x.stride(0),
        weight.stride(0), weight.stride(1), s.stride(0), y.stride(0),
        residual.stride(0) if residual is not None else 0, n_ss, eps, 0.0, SCALE=mode, GROUP=group,
        HAS_BIAS=bias is not None, NORM=norm is not None, S_IN=triton.next_power_of_2(n_ss), GATED=gated,
        RES=residual is not None, SS_OUT=sumsq, PREC=prec, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split, SPLITS=splits, PREFETCH=prefetch(weight, p, m), LATE=release_late(p, m, k),
        num_warps=warps, num_stages=stages, **pdl_flags(x.device))
    return (y, ss) if sumsq else y


def row_sumsq(x: torch.Tensor) -> torch.Tensor:
    """The partial sums of squares of x's rows [M, N] in float32, one per SUMSQ_GROUP
    columns: [M, ceil(N / SUMSQ_GROUP)], `invariant_matmul`'s `norm`."""
    assert x.dim() == 2 and x.stride(-1) == 1, x.shape
    m, n = x.shape
    n_ss = triton.cdiv(n, SUMSQ_GROUP)
    ss = torch.empty(m, n_ss, dtype=torch.float32, device=x.device)
    if m:
        _row_sumsq_kernel[(m,)](x, ss, n, x.stride(0), n_ss, S=triton.next_power_of_2(n_ss), GROUP=SUMSQ_GROUP,
                                num_warps=4, **pdl_flags(x.device))
    return ss
