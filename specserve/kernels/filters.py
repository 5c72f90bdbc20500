"""Sampling filters without a sort: each row's top-k, top-p and min-p as one floor.

The filters keep an upper set of a row's logits, so each row's kept tokens are exactly
those whose logit is at least one value, its floor: a draw (argmax.py) masks the tokens
below it, and nothing is sorted or scattered. The sets, for a row l with temperature T,
e_v = exp((l_v - max l) / T) and Z = sum e (`runner.sampler.filter_floors` is the torch
reference, which sorts):

  * top-k keeps v when fewer than k tokens have a larger logit (ties at the k-th value all stay);
  * top-p keeps v when the tokens with a larger logit hold less than p Z (the same, by mass);
  * min-p keeps v when e_v >= min_p, i.e. l_v >= max l + T log(min_p).

Top-k and top-p need the row's order statistics, found in a bracket: a cut point t is
kept when fewer than k tokens lie above it and they hold less than p Z, and the floor is
the least logit whose cut is kept. Invariant: the upper end `hi` is kept, the lower `lo`
is not. Once at most CAP tokens lie in (lo, hi], they are gathered, sorted in registers,
and walked from `hi`'s count and mass. Two ways to get there, with the same floors:

  * many rows (SPREAD_ROWS or more): one program a row. A first pass over the row finds
    its maximum and Z; then each pass counts the tokens above one cut point (and adds
    their e where top-p asks) and keeps one half of the bracket. The first passes halve
    the value range, later ones the float's ordered bit pattern, so a bracket always
    closes within 32 more passes: at adjacent floats every token in (lo, hi] equals hi,
    and hi is the floor. (Three cut points a pass, to halve the passes, measured slower:
    a pass is bound by its arithmetic as much as by its loads.) A row with min-p alone
    takes the first pass only, a row with no filter none;
  * fewer rows (a batch-1 decode, a verify's few nodes): one program streaming the row
    a pass at a time leaves the GPU idle, so each row's passes are spread over programs
    of a chunk each, and each pass counts above several cut points at once
    (filters_spread.py). Its last program bisects here like the one above when its
    bracket still holds more than CAP tokens.

Rows of a verify share their request's parameters (per_request rows each), as in argmax.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl_flags
from specserve.kernels.pdl import wait_and_release

SPREAD_ROWS = 16  # fewer rows take filters_spread.py
BLOCK = 4096  # logits per step of a pass
CAP = 1024  # tokens gathered and sorted once the bracket holds no more
INTERPRETED_CAP = 128  # under the Triton interpreter (CPU tests), whose sort is slow
VALUE_PASSES = 12  # then the ordered bit pattern is halved (at most 32 passes more)
LOG2E = 1.4426950408889634


@triton.jit
def _key(x):
    """The float's bits as an int32 ordered like the floats (ties aside: -0 < +0)."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _unkey(k):
    return tl.where(k < 0, k ^ 0x7FFFFFFF, k).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _block(row, start, V, BLOCK: tl.constexpr):
    """The row's logits [start, start + BLOCK) in float32, -inf past V."""
    cols = start + tl.arange(0, BLOCK)
    return tl.load(row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)


@triton.jit
def _params(temp_ptr, topk_ptr, topp_ptr, minp_ptr, q, V):
    """(T, k, p, min_p, log2(e) / T, whether any filter is on) of request q."""
    t = tl.maximum(tl.load(temp_ptr + q), 1e-5)
    k = tl.load(topk_ptr + q)
    p = tl.load(topp_ptr + q)
    min_p = tl.load(minp_ptr + q)
    return t, k, p, min_p, 1.4426950408889634 / t, (k < V) | (p < 1.0) | (min_p > 0)


@triton.jit
def _targets(k, p, n_fin, z):
    """(whether the row needs a bracket, the count and the mass a kept cut stays under),
    n_fin its finite tokens (float32): a top-k of every finite token keeps them all, a
    top-p of 1 every mass."""
    has_k = k < n_fin
    has_p = p < 1.0
    k_eff = tl.where(has_k, k.to(tl.float32), n_fin + 1.0)
    return (has_k | has_p) & (n_fin > 0), k_eff, tl.where(has_p, p * z, float("inf"))


@triton.jit
def _above(row, V, t, lmax, c, with_mass, BLOCK: tl.constexpr):
    """(tokens with logit > t, their sum of exp2((l - lmax) c) if with_mass, else 0). Each
    step loads the next block before it adds up the current one: one program streams the
    row, so the loads' latency would otherwise set its pace."""
    n = tl.zeros([BLOCK], dtype=tl.int32)
    mass = tl.zeros([BLOCK], dtype=tl.float32)
    x = _block(row, 0, V, BLOCK)
    for start in range(BLOCK, V + BLOCK, BLOCK):
        x_next = _block(row, start, V, BLOCK)
        up = x > t
        n += up.to(tl.int32)
        if with_mass:
            mass += tl.where(up, tl.exp2((x - lmax) * c), 0.0)
        x = x_next
    return tl.sum(n, axis=0).to(tl.float32), tl.sum(mass, axis=0)


@triton.jit
def _cut(lo, hi, by_value):
    """A cut point lo < mid < hi: the middle value while `by_value` and it falls strictly
    inside, else the middle of the floats' ordered bits. The flag is False when no float
    lies strictly between lo and hi."""
    v = lo + (hi - lo) * 0.5
    lk = _key(lo).to(tl.int64)
    b = _unkey((lk + (_key(hi).to(tl.int64) - lk) // 2).to(tl.int32))
    mid = tl.where(by_value & (v > lo) & (v < hi), v, b)
    return mid, (mid > lo) & (mid < hi)


@triton.jit
def _bisect(row, V, lo, hi, c_lo, c_hi, m_hi, k, pz, lmax, c, with_mass, BLOCK: tl.constexpr, CAP: tl.constexpr,
            VALUE_PASSES: tl.constexpr):
    """The bracket (lo, hi] with c_lo tokens above lo, c_hi of mass m_hi above hi, halved
    a pass over the row at a time until at most CAP tokens lie in it or no float does."""
    passes = 0
    go = c_lo - c_hi > CAP
    while go:
        mid, go = _cut(lo, hi, passes < VALUE_PASSES)
        if go:
            n, m = _above(row, V, mid, lmax, c, with_mass, BLOCK)
            if (n < k) & (m < pz):  # mid is kept
                hi = mid
                c_hi = n
                m_hi = m
            else:
                lo = mid
                c_lo = n
        passes += 1
        go = go & (c_lo - c_hi > CAP)
    return lo, hi, c_lo, c_hi, m_hi


@triton.jit
def _gather(row, V, lo, hi, buf, BLOCK: tl.constexpr):
    """Store the row's logits in (lo, hi] to buf[0:], in column order."""
    at = 0
    for start in range(0, V, BLOCK):
        x = _block(row, start, V, BLOCK)
        sel = (x > lo) & (x <= hi)
        pos = at + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(buf + pos, x, mask=sel)
        at += tl.sum(sel.to(tl.int32), axis=0)


@triton.jit
def _walk(buf, n_in, c_hi, m_hi, k, pz, lmax, c, CAP: tl.constexpr):
    """The smallest of the n_in gathered logits that is kept (fewer than k tokens and less
    than pz mass above it), given that c_hi tokens of mass m_hi lie above them all."""
    i = tl.arange(0, CAP)
    s = tl.sort(tl.load(buf + i, mask=i < n_in, other=float("-inf")), descending=True)
    e = tl.exp2((s - lmax) * c)
    before = tl.cumsum(e, axis=0) - e  # mass of the gathered tokens ahead of each
    ok = (i < n_in) & (c_hi + i < k) & (m_hi + before < pz)
    return tl.min(tl.where(ok, s, float("inf")), axis=0)


@triton.jit
def _stats(row, V, c, with_mass, BLOCK: tl.constexpr):
    """One pass: (max, min finite, finite count, Z = sum exp2((l - max) c) if with_mass).
    Z is kept per lane against the lane's own running max (one exp2 a logit: the term
    when the max stays, the rescale when it moves) and brought to the row's max at the end."""
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    bottom = tl.full([BLOCK], float("inf"), tl.float32)
    finite = tl.zeros([BLOCK], dtype=tl.int32)
    z = tl.zeros([BLOCK], dtype=tl.float32)
    x = _block(row, 0, V, BLOCK)
    for start in range(BLOCK, V + BLOCK, BLOCK):
        x_next = _block(row, start, V, BLOCK)
        live = x > float("-inf")
        if with_mass:
            up = x > top
            d = tl.where(live, tl.abs(x - top), float("inf"))  # -inf - -inf: a dead lane adds nothing
            e = tl.exp2(-d * c)
            z = tl.where(up, z * e + 1.0, z + e)
        top = tl.maximum(top, x)
        bottom = tl.minimum(bottom, tl.where(live, x, float("inf")))
        finite += live.to(tl.int32)
        x = x_next
    lmax = tl.max(top, axis=0)
    zs = tl.sum(tl.where(top > float("-inf"), z * tl.exp2((top - lmax) * c), 0.0), axis=0)
    return lmax, tl.min(bottom, axis=0), tl.sum(finite, axis=0).to(tl.float32), zs


@triton.jit
def _floor(row, buf, V, t, k, p, min_p, c, BLOCK: tl.constexpr, CAP: tl.constexpr, VALUE_PASSES: tl.constexpr):
    """The row's floor (module docstring), one program: one pass for its maximum and Z,
    bisection passes until at most CAP logits lie in the bracket, one to gather them."""
    lmax, lmin, n_fin, z = _stats(row, V, c, p < 1.0, BLOCK)
    floor = tl.where(min_p > 0, lmax + t * tl.log(min_p), float("-inf"))
    search, k_eff, pz = _targets(k, p, n_fin, z)
    if search:
        # lo: below the least finite logit (none kept there: n_fin >= k or Z >= p Z; two
        # steps down: one from +0 is -0, which no logit exceeds); hi: the max (kept)
        lo, hi, c_lo, c_hi, m_hi = _bisect(row, V, _unkey(_key(lmin) - 2), lmax, n_fin, n_fin * 0.0, z * 0.0, k_eff,
                                           pz, lmax, c, p < 1.0, BLOCK, CAP, VALUE_PASSES)
        n_in = (c_lo - c_hi).to(tl.int32)
        found = hi  # more than CAP tokens in (lo, hi]: adjacent floats, all of them equal hi
        if n_in <= CAP:
            _gather(row, V, lo, hi, buf, BLOCK)
            tl.debug_barrier()  # the gathered logits, stored by other threads of the program
            found = _walk(buf, n_in, c_hi, m_hi, k_eff, pz, lmax, c, CAP)
        floor = tl.maximum(floor, found)
    return floor


@triton.jit
def _floors_kernel(x_ptr, out_ptr, buf_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, V, stride_x, PER_REQ,
                   BLOCK: tl.constexpr, CAP: tl.constexpr, VALUE_PASSES: tl.constexpr, USE_PDL: tl.constexpr):
    wait_and_release(USE_PDL)  # the logits are the kernel before's
    r = tl.program_id(0).to(tl.int64)
    t, k, p, min_p, c, on = _params(temp_ptr, topk_ptr, topp_ptr, minp_ptr, r // PER_REQ, V)
    floor = tl.full([], float("-inf"), tl.float32)
    if on:  # else nothing is filtered: no pass over the row
        floor = _floor(x_ptr + r * stride_x, buf_ptr + r * CAP, V, t, k, p, min_p, c, BLOCK, CAP, VALUE_PASSES)
    tl.store(out_ptr + r, floor)


def filter_floors(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, per_request: int = 1) -> torch.Tensor:
    """logits [R, V] (unit stride along V); temperature, top_p, min_p float32 and top_k int64,
    [R / per_request] each -> [R] float32: each row's floor (-inf where nothing is filtered)."""
    rows, v = logits.shape
    assert temperature.numel() * per_request == rows, "one set of params per request"
    if rows < SPREAD_ROWS:
        from specserve.kernels import filters_spread

        return filters_spread.filter_floors(logits, temperature, top_k, top_p, min_p, per_request)
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    cap = CAP if logits.is_cuda else min(CAP, INTERPRETED_CAP)
    buf = torch.empty(rows, cap, dtype=torch.float32, device=logits.device)
    _floors_kernel[(rows,)](logits, out, buf, temperature, top_k, top_p, min_p, v, logits.stride(0), per_request,
                            BLOCK=BLOCK, CAP=cap, VALUE_PASSES=VALUE_PASSES, num_warps=16, **pdl_flags(logits.device))
    return out
