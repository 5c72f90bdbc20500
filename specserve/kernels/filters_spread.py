"""The sampling filters' floors of a few rows (filters.py says what a floor is), each row's
work spread over programs of CHUNK logits.

One program streaming a row is slow where few rows leave the GPU idle: each of its passes
(filters.py) reads the row on one multiprocessor. Here each row's bracket is narrowed in
launches whose programs take a chunk each, every launch reading what the ones before wrote:

  1. stats: each chunk's maximum, Z against it, least finite logit, finite count, mean
     and squared deviations;
  2. ROUNDS rounds: each program merges the stats (the first round) or the round before's
     counts (the others) into the row's bracket, program 0 stores it, and each chunk
     counts its tokens, and their e, above CUTS cut points inside the bracket. The first
     round places the cuts at the row's normal quantiles (its mean and deviation; a
     logistic fit), which split a bell-shaped row evenly, the others evenly in value.
     The last round also keeps each chunk's logits in its bracket, at most SLOT of them;
  3. one program a row merges the last round, bisects as filters.py does while the
     bracket holds more than CAP tokens (ties, or a cluster the cuts did not split),
     gathers its logits (the chunks' kept ones, or from the row where a chunk held more
     than SLOT), sorts them and walks them.

A round counts against the cuts its program 0 stores, and each round keeps its own copy
of the state, so no launch needs atomics and a batch size's grids are fixed: the launches
replay in a CUDA graph. A round's counting loop has no branch, so its loads go out
together. A row whose bracket is small enough skips the later rounds' counting; a row
with min-p alone takes the stats, a row with no filter a parameter read a program.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import filters, pdl_flags
from specserve.kernels.filters import _bisect, _block, _gather, _key, _params, _targets, _unkey, _walk
from specserve.kernels.pdl import wait_and_release

CHUNK = 1024  # logits per program of the stats and the rounds
SUB = 128  # logits a step of a chunk's count against the cuts
CUTS = 8  # cut points a round counts above
ROUNDS = 4  # rounds of cuts before the last program's walk
SLOT = 64  # logits of the last round's bracket each chunk keeps
CAP = 256  # tokens gathered and sorted once the bracket holds no more
INTERPRETED = {"CHUNK": 256, "SUB": 64, "CAP": 128}  # under the Triton interpreter (CPU tests): smaller
STATS = 8  # floats of a chunk's stats
STATE = 16  # floats of a row's state after a round


@triton.jit
def _stats_kernel(x_ptr, stats_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, V, stride_x, PER_REQ, C,
                  CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (r, ch): chunk ch's (max, Z against it, least finite, finite count, mean,
    squared deviations from it) into stats[r, ch]."""
    wait_and_release(USE_PDL)  # the logits are the kernel before's
    r = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1)
    _, _, _, _, c, on = _params(temp_ptr, topk_ptr, topp_ptr, minp_ptr, r // PER_REQ, V)
    if on:
        x = _block(x_ptr + r * stride_x, ch * CHUNK, V, CHUNK)
        live = x > float("-inf")
        top = tl.max(x, axis=0)
        n = tl.sum(live.to(tl.float32), axis=0)
        mean = tl.sum(tl.where(live, x, 0.0), axis=0) / tl.maximum(n, 1.0)
        out = stats_ptr + (r * C + ch) * 8
        tl.store(out, top)
        tl.store(out + 1, tl.sum(tl.where(live, tl.exp2((x - top) * c), 0.0), axis=0))
        tl.store(out + 2, tl.min(tl.where(live, x, float("inf")), axis=0))
        tl.store(out + 3, n)
        tl.store(out + 4, mean)
        tl.store(out + 5, tl.sum(tl.where(live, (x - mean) * (x - mean), 0.0), axis=0))


@triton.jit
def _merge_stats(stats, C, c, BLOCK_C: tl.constexpr):
    """The row's (max, least finite, finite count, Z, mean, deviation) from its C chunks'."""
    i = tl.arange(0, BLOCK_C) * 8
    live = i < C * 8
    top = tl.load(stats + i, mask=live, other=float("-inf"))
    n = tl.load(stats + i + 3, mask=live, other=0.0)
    mean_c = tl.load(stats + i + 4, mask=live, other=0.0)
    lmax = tl.max(top, axis=0)
    n_fin = tl.sum(n, axis=0)
    z = tl.sum(tl.where(top > float("-inf"), tl.load(stats + i + 1, mask=live, other=0.0) * tl.exp2((top - lmax) * c),
                        0.0), axis=0)
    mean = tl.sum(n * mean_c, axis=0) / tl.maximum(n_fin, 1.0)
    dev2 = tl.load(stats + i + 5, mask=live, other=0.0) + n * (mean_c - mean) * (mean_c - mean)  # Chan's merge
    std = tl.sqrt(tl.sum(dev2, axis=0) / tl.maximum(n_fin, 1.0))
    return lmax, tl.min(tl.load(stats + i + 2, mask=live, other=float("inf")), axis=0), n_fin, z, mean, std


@triton.jit
def _cuts(lo, hi, mean, std, QUANTILE: tl.constexpr, CUTS: tl.constexpr):
    """CUTS cut points in [lo, hi]: evenly spaced, or (QUANTILE, and a deviation to fit)
    at the normal quantiles of mean and std (logit(u) / 1.702 is about the u-quantile)."""
    u = (tl.arange(0, CUTS) + 1).to(tl.float32) / (CUTS + 1)
    cut = lo + (hi - lo) * u
    if QUANTILE:
        cut = tl.where(std > 0, mean + std * tl.log(u / (1.0 - u)) * 0.5876, cut)
    return tl.minimum(tl.maximum(cut, lo), hi)


@triton.jit
def _count_above(row, start, V, cuts, lmax, c, CHUNK: tl.constexpr, SUB: tl.constexpr, CUTS: tl.constexpr):
    """[CUTS] each: the chunk's tokens above each cut and their sum of exp2((l - lmax) c),
    counted in steps of SUB logits (unrolled, without a branch: the steps' loads go out
    together)."""
    n = tl.zeros([CUTS, SUB], dtype=tl.float32)
    m = tl.zeros([CUTS, SUB], dtype=tl.float32)
    for s in tl.static_range(0, CHUNK, SUB):
        x = _block(row, start + s, V, SUB)
        up = x[None, :] > cuts[:, None]
        n += up.to(tl.float32)
        m += tl.where(up, tl.exp2((x - lmax) * c)[None, :], 0.0)
    return tl.sum(n, axis=1), tl.sum(m, axis=1)


@triton.jit
def _narrow(lo, hi, c_lo, c_hi, m_hi, cuts, n, m, k, pz):
    """The bracket after a round, from the row's counts n and masses m above its cuts: the
    highest cut inside (lo, hi) that is not kept becomes lo, the lowest kept one hi."""
    inside = (cuts > lo) & (cuts < hi)
    kept = (n < k) & (m < pz)
    new_hi = tl.min(tl.where(inside & kept, cuts, float("inf")), axis=0)
    at_hi = inside & kept & (cuts == new_hi)
    dropped = inside & ((n >= k) | (m >= pz))
    new_lo = tl.max(tl.where(dropped, cuts, float("-inf")), axis=0)
    at_lo = dropped & (cuts == new_lo)
    up = new_hi < float("inf")
    down = new_lo > float("-inf")
    c_lo = tl.where(down, tl.max(tl.where(at_lo, n, 0.0), axis=0), c_lo)
    c_hi = tl.where(up, tl.max(tl.where(at_hi, n, 0.0), axis=0), c_hi)
    m_hi = tl.where(up, tl.max(tl.where(at_hi, m, 0.0), axis=0), m_hi)
    return tl.where(down, new_lo, lo), tl.where(up, new_hi, hi), c_lo, c_hi, m_hi


@triton.jit
def _merge_round(lo, hi, c_lo, c_hi, m_hi, cuts, part, C, k, pz, CUTS: tl.constexpr, BLOCK_C: tl.constexpr):
    """`_narrow` by a round's cuts and its chunks' counts part [C, 2, CUTS]."""
    ch = tl.arange(0, BLOCK_C)[:, None] * (2 * CUTS)
    j = tl.arange(0, CUTS)[None, :]
    live = ch < C * 2 * CUTS
    n = tl.sum(tl.load(part + ch + j, mask=live, other=0.0), axis=0)
    m = tl.sum(tl.load(part + ch + CUTS + j, mask=live, other=0.0), axis=0)
    return _narrow(lo, hi, c_lo, c_hi, m_hi, tl.load(cuts + tl.arange(0, CUTS)), n, m, k, pz)


@triton.jit
def _load_state(st):
    """(max, Z, finite count, mean, deviation, lo, hi, c_lo, c_hi, m_hi) of a row."""
    return (tl.load(st), tl.load(st + 1), tl.load(st + 2), tl.load(st + 3), tl.load(st + 4), tl.load(st + 5),
            tl.load(st + 6), tl.load(st + 7), tl.load(st + 8), tl.load(st + 9))


@triton.jit
def _store_state(st, lmax, z, n_fin, mean, std, lo, hi, c_lo, c_hi, m_hi):
    tl.store(st, lmax)
    tl.store(st + 1, z)
    tl.store(st + 2, n_fin)
    tl.store(st + 3, mean)
    tl.store(st + 4, std)
    tl.store(st + 5, lo)
    tl.store(st + 6, hi)
    tl.store(st + 7, c_lo)
    tl.store(st + 8, c_hi)
    tl.store(st + 9, m_hi)


@triton.jit
def _keep_slots(row, start, V, lo, hi, slots, slot_n, CHUNK: tl.constexpr, SLOT: tl.constexpr):
    """The chunk's logits in (lo, hi], the first SLOT of them in column order, into
    slots; how many there are (more than SLOT: some were left out) into slot_n."""
    x = _block(row, start, V, CHUNK)
    sel = (x > lo) & (x <= hi)
    pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
    tl.store(slots + pos, x, mask=sel & (pos < SLOT))
    tl.store(slot_n, tl.sum(sel.to(tl.float32), axis=0))


@triton.jit
def _round_kernel(x_ptr, stats_ptr, state_ptr, cuts_ptr, part_ptr, slot_ptr, slot_n_ptr, temp_ptr, topk_ptr, topp_ptr,
                  minp_ptr, V, stride_x, PER_REQ, C, ROUND: tl.constexpr, ROUNDS: tl.constexpr, CHUNK: tl.constexpr,
                  SUB: tl.constexpr, CUTS: tl.constexpr, CAP: tl.constexpr, SLOT: tl.constexpr,
                  BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (r, ch) of round ROUND: row r's bracket from the stage before (program 0
    stores it to state[r, ROUND]), then chunk ch's counts above the round's cuts into
    part[r, ROUND, ch] (and, the last round, its logits in the bracket into slots)."""
    wait_and_release(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1)
    _, k, p, _, c, on = _params(temp_ptr, topk_ptr, topp_ptr, minp_ptr, r // PER_REQ, V)
    if on:
        if ROUND == 0:
            lmax, lmin, n_fin, z, mean, std = _merge_stats(stats_ptr + r * C * 8, C, c, BLOCK_C)
            # lo: below the least finite logit (none kept there: n_fin >= k or Z >= p Z; two
            # steps down: one from +0 is -0, which no logit exceeds); hi: the max (kept)
            lo = _unkey(_key(lmin) - 2)
            hi = lmax
            c_lo = n_fin
            c_hi = n_fin * 0.0
            m_hi = z * 0.0
        else:
            lmax, z, n_fin, mean, std, lo, hi, c_lo, c_hi, m_hi = _load_state(state_ptr + (r * ROUNDS + ROUND - 1) * 16)
        search, k_eff, pz = _targets(k, p, n_fin, z)
        if ROUND > 0:
            if search & (c_lo - c_hi > CAP):  # the round before counted
                at = r * ROUNDS + ROUND - 1
                lo, hi, c_lo, c_hi, m_hi = _merge_round(lo, hi, c_lo, c_hi, m_hi, cuts_ptr + at * CUTS,
                                                        part_ptr + at * C * 2 * CUTS, C, k_eff, pz, CUTS, BLOCK_C)
        at = r * ROUNDS + ROUND
        if ch == 0:
            _store_state(state_ptr + at * 16, lmax, z, n_fin, mean, std, lo, hi, c_lo, c_hi, m_hi)
        row = x_ptr + r * stride_x
        if search & (c_lo - c_hi > CAP):
            cuts = _cuts(lo, hi, mean, std, ROUND == 0, CUTS)
            if ch == 0:
                tl.store(cuts_ptr + at * CUTS + tl.arange(0, CUTS), cuts)
            n, m = _count_above(row, ch * CHUNK, V, cuts, lmax, c, CHUNK, SUB, CUTS)
            part = part_ptr + (at * C + ch) * 2 * CUTS + tl.arange(0, CUTS)
            tl.store(part, n)
            tl.store(part + CUTS, m)
        if search & (ROUND == ROUNDS - 1):
            at = r * C + ch
            _keep_slots(row, ch * CHUNK, V, lo, hi, slot_ptr + at * SLOT, slot_n_ptr + at, CHUNK, SLOT)


@triton.jit
def _gather_slots(slots, slot_n, C, lo, hi, buf, SLOT: tl.constexpr, BLOCK_C: tl.constexpr):
    """Store the chunks' kept logits that lie in (lo, hi] to buf[0:]."""
    ch = tl.arange(0, BLOCK_C)[:, None]
    j = tl.arange(0, SLOT)[None, :]
    valid = j < tl.load(slot_n + ch, mask=ch < C, other=0.0)
    x = tl.load(slots + ch * SLOT + j, mask=valid, other=float("-inf"))
    sel = (valid & (x > lo) & (x <= hi)).to(tl.int32)
    per = tl.sum(sel, axis=1)
    pos = (tl.cumsum(per, axis=0) - per)[:, None] + tl.cumsum(sel, axis=1) - 1
    tl.store(buf + pos, x, mask=sel > 0)


@triton.jit
def _final_kernel(x_ptr, out_ptr, state_ptr, cuts_ptr, part_ptr, slot_ptr, slot_n_ptr, buf_ptr, temp_ptr, topk_ptr,
                  topp_ptr, minp_ptr, V, stride_x, PER_REQ, C, ROUNDS: tl.constexpr, CUTS: tl.constexpr,
                  CAP: tl.constexpr, SLOT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
                  VALUE_PASSES: tl.constexpr, USE_PDL: tl.constexpr):
    """Program r: row r's floor, from its state after the last round (module docstring)."""
    wait_and_release(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    t, k, p, min_p, c, on = _params(temp_ptr, topk_ptr, topp_ptr, minp_ptr, r // PER_REQ, V)
    floor = tl.full([], float("-inf"), tl.float32)
    if on:  # else nothing is filtered
        at = r * ROUNDS + ROUNDS - 1
        lmax, z, n_fin, _, _, lo, hi, c_lo, c_hi, m_hi = _load_state(state_ptr + at * 16)
        floor = tl.where(min_p > 0, lmax + t * tl.log(min_p), float("-inf"))
        search, k_eff, pz = _targets(k, p, n_fin, z)
        if search:
            if c_lo - c_hi > CAP:  # the last round counted
                lo, hi, c_lo, c_hi, m_hi = _merge_round(lo, hi, c_lo, c_hi, m_hi, cuts_ptr + at * CUTS,
                                                        part_ptr + at * C * 2 * CUTS, C, k_eff, pz, CUTS, BLOCK_C)
            row = x_ptr + r * stride_x
            lo, hi, c_lo, c_hi, m_hi = _bisect(row, V, lo, hi, c_lo, c_hi, m_hi, k_eff, pz, lmax, c, p < 1.0, BLOCK,
                                               CAP, VALUE_PASSES)
            n_in = (c_lo - c_hi).to(tl.int32)
            found = hi  # more than CAP tokens in (lo, hi]: adjacent floats, all of them equal hi
            if n_in <= CAP:
                slot_n = slot_n_ptr + r * C
                buf = buf_ptr + r * CAP
                held = tl.load(slot_n + tl.arange(0, BLOCK_C), mask=tl.arange(0, BLOCK_C) < C, other=0.0)
                if tl.max(held, axis=0) > SLOT:  # some chunk left logits out: from the row
                    _gather(row, V, lo, hi, buf, BLOCK)
                else:
                    _gather_slots(slot_ptr + r * C * SLOT, slot_n, C, lo, hi, buf, SLOT, BLOCK_C)
                tl.debug_barrier()  # the gathered logits, stored by other threads of the program
                found = _walk(buf, n_in, c_hi, m_hi, k_eff, pz, lmax, c, CAP)
            floor = tl.maximum(floor, found)
    tl.store(out_ptr + r, floor)


def filter_floors(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, per_request: int = 1) -> torch.Tensor:
    """filters.filter_floors, each row's work spread over its chunks: 2 + ROUNDS launches."""
    rows, v = logits.shape
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if not rows:
        return out
    sizes = {"CHUNK": CHUNK, "SUB": SUB, "CAP": CAP}
    if not logits.is_cuda:
        sizes = {name: min(n, INTERPRETED[name]) for name, n in sizes.items()}
    chunk, cap = sizes["CHUNK"], sizes["CAP"]
    chunks = triton.cdiv(v, chunk)
    widths = [chunks * STATS, chunks * 2 * ROUNDS * CUTS, chunks * SLOT, chunks, ROUNDS * STATE, ROUNDS * CUTS, cap]
    work = torch.empty(rows * sum(widths), dtype=torch.float32, device=logits.device)
    stats, part, slots, slot_n, state, cuts, buf = work.split([rows * w for w in widths])  # each [R, w]
    params = (temperature, top_k, top_p, min_p, v, logits.stride(0), per_request, chunks)
    pdl = pdl_flags(logits.device)
    block_c = max(2, triton.next_power_of_2(chunks))
    _stats_kernel[(rows, chunks)](logits, stats, *params, CHUNK=chunk, num_warps=4, **pdl)
    for i in range(ROUNDS):
        _round_kernel[(rows, chunks)](logits, stats, state, cuts, part, slots, slot_n, *params, ROUND=i, ROUNDS=ROUNDS,
                                      CUTS=CUTS, SLOT=SLOT, BLOCK_C=block_c, **sizes, num_warps=4, **pdl)
    _final_kernel[(rows,)](logits, out, state, cuts, part, slots, slot_n, buf, *params, ROUNDS=ROUNDS, CUTS=CUTS,
                           CAP=cap, SLOT=SLOT, BLOCK=filters.BLOCK, BLOCK_C=block_c, VALUE_PASSES=filters.VALUE_PASSES,
                           num_warps=8, **pdl)
    return out
