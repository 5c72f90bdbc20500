"""One tree-drafting depth's bookkeeping in one Triton launch (`spec.tree_draft.expand`).

After a draft forward over a depth's B*k frontier branches and their top-k children,
the torch path scores the k*k children of each request by path log-probability, records
their parents, takes the request's k best as the next frontier, and moves each chosen
child's branch state and attention tail (its ancestors' scratch slots) to its new row,
appending the next depth's slot: about a dozen launches per depth. Here one program per
request does all of it.

Per request b (branch j of b is row b*k + j; child c = j*k + i is child i of branch j),
into the pass's candidate buffers (`cand`: scores, tokens, parents [B, M]) at columns
size + c, so the pass concatenates nothing before its node selection:
  kid_score[b, c] = score[b, j] + logp[b*k + j, i]     parents[b, c] = frontier[b, j]
  kid_token[b, c] = kid[b*k + j, i]
  (the first depth also writes columns 0..k-1, the root's children: score, first
  tokens, parent -1)
  the k best children p_0..p_{k-1} in descending score (ties: lower index first):
  new_score[b, t] = kid_score[b, p_t]    new_token[b, t] = kid[b*k + p_t // k, p_t % k]
  new_frontier[b, t] = size + p_t        (candidate numbering: this depth starts at size)
  and, unless this is the last depth, with src = b*k + p_t // k:
  new_states[b*k + t] = states[src]      new_tail[b*k + t] = [tail[src], next_slots[b*k + t]]
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl_flags
from specserve.kernels.pdl import wait_and_release
from specserve.kernels.topk import k_best

Candidates = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # a pass's scores, tokens, parents [B, M]


@triton.jit
def _frontier_kernel(score_ptr, logp_ptr, kid_ptr, frontier_ptr, size,
                     new_score_ptr, new_token_ptr, new_frontier_ptr,
                     states_ptr, new_states_ptr, H, tail_ptr, new_tail_ptr, D, next_slots_ptr,
                     cs_ptr, ct_ptr, cp_ptr, first_tok_ptr, M,
                     K: tl.constexpr, KK: tl.constexpr, KB: tl.constexpr, HB: tl.constexpr, DB: tl.constexpr,
                     MOVE: tl.constexpr, HAS_STATES: tl.constexpr, FIRST: tl.constexpr, USE_PDL: tl.constexpr):
    wait_and_release(USE_PDL)  # the scores and children are the kernels before's
    b = tl.program_id(0)
    c = tl.arange(0, KK)
    valid = c < K * K
    branch = c // K
    s = tl.load(score_ptr + b * K + branch, mask=valid, other=0.0) + \
        tl.load(logp_ptr + b * K * K + c, mask=valid, other=0.0)
    s = tl.where(valid, s, float("-inf"))
    row = b.to(tl.int64) * M  # the candidate buffers' row; this depth's children at columns size..
    tl.store(cs_ptr + row + size + c, s, mask=valid)
    tl.store(ct_ptr + row + size + c, tl.load(kid_ptr + b * K * K + c, mask=valid, other=0), mask=valid)
    tl.store(cp_ptr + row + size + c, tl.load(frontier_ptr + b * K + branch, mask=valid, other=0), mask=valid)
    if FIRST:  # columns 0..k-1: the root's children
        t0 = tl.arange(0, KB)
        first = t0 < K
        tl.store(cs_ptr + row + t0, tl.load(score_ptr + b * K + t0, mask=first, other=0.0), mask=first)
        tl.store(ct_ptr + row + t0, tl.load(first_tok_ptr + b * K + t0, mask=first, other=0), mask=first)
        tl.store(cp_ptr + row + t0, tl.full([KB], -1, tl.int64), mask=first)
    # the k best first, in registers; then every load and copy at once (a load per round
    # would put k memory round trips in series)
    bests, picks = k_best(s, c, K, KB)
    t = tl.arange(0, KB)
    keep = t < K
    tl.store(new_score_ptr + b * K + t, bests, mask=keep)
    tl.store(new_token_ptr + b * K + t, tl.load(kid_ptr + b * K * K + picks, mask=keep, other=0), mask=keep)
    tl.store(new_frontier_ptr + b * K + t, size + picks, mask=keep)
    if MOVE:
        src = b * K + picks // K
        dst = b * K + t
        if HAS_STATES:
            for h0 in range(0, H, HB):
                h = h0 + tl.arange(0, HB)
                both = keep[:, None] & (h < H)[None, :]
                tl.store(new_states_ptr + dst[:, None] * H + h[None, :],
                         tl.load(states_ptr + src[:, None] * H + h[None, :], mask=both), mask=both)
        d = tl.arange(0, DB)
        both = keep[:, None] & (d < D)[None, :]
        tl.store(new_tail_ptr + dst[:, None] * (D + 1) + d[None, :],
                 tl.load(tail_ptr + src[:, None] * D + d[None, :], mask=both), mask=both)
        tl.store(new_tail_ptr + dst * (D + 1) + D, tl.load(next_slots_ptr + dst, mask=keep), mask=keep)


def tree_frontier(score: torch.Tensor, logp: torch.Tensor, kid: torch.Tensor, frontier: torch.Tensor, size: int,
                  states: torch.Tensor | None, tail: torch.Tensor | None, next_slots: torch.Tensor | None,
                  cand: Candidates, first_tokens: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """score [B, k] f32, logp / kid [B*k, k] (f32 / int64), frontier [B, k] int64, and for a
    depth that is not the last the branch states [B*k, H] (or None), tail [B*k, D] int64 and
    next_slots [B*k] int64; the children go into columns size.. of `cand` (contiguous [B, M]
    float32 scores, int64 tokens and parents), and with `first_tokens` [B, k] (the first
    depth) the root's children into columns 0..k-1 (see the module docstring). Returns
    (new_score [B, k], new_token [B, k], new_frontier [B, k], new_states [B*k, H] or None,
    new_tail [B*k, D + 1] or None)."""
    bsz, k = score.shape
    dev = score.device
    score, logp, kid, frontier = (t.contiguous() for t in (score, logp, kid, frontier))
    assert all(t.is_contiguous() and t.shape[0] == bsz for t in cand) and cand[0].shape[1] >= size + k * k
    first_tokens = first_tokens.contiguous() if first_tokens is not None else None
    new_score = torch.empty(bsz, k, dtype=torch.float32, device=dev)
    new_token = torch.empty(bsz, k, dtype=torch.int64, device=dev)
    new_frontier = torch.empty(bsz, k, dtype=torch.int64, device=dev)
    move = tail is not None
    new_states = new_tail = None
    h = d = 1
    if tail is not None:  # `move`
        assert next_slots is not None and tail.dtype == torch.int64, "a moving depth needs its tail and next slots"
        tail, next_slots = tail.contiguous(), next_slots.contiguous()
        d = tail.shape[1]
        new_tail = torch.empty(bsz * k, d + 1, dtype=torch.int64, device=dev)
        if states is not None:
            states = states.contiguous()
            h = states.shape[1]
            new_states = torch.empty_like(states)
    if bsz == 0:
        return new_score, new_token, new_frontier, new_states, new_tail
    _frontier_kernel[(bsz,)](
        score, logp, kid, frontier, size, new_score, new_token, new_frontier,
        states if new_states is not None else score, new_states if new_states is not None else score, h,
        tail if move else frontier, new_tail if move else frontier, d, next_slots if move else frontier,
        *cand, first_tokens if first_tokens is not None else kid, cand[0].shape[1], FIRST=first_tokens is not None,
        K=k, KK=triton.next_power_of_2(k * k), KB=max(2, triton.next_power_of_2(k)),
        HB=min(1024, triton.next_power_of_2(h)), DB=triton.next_power_of_2(d), MOVE=move,
        HAS_STATES=new_states is not None, num_warps=4, **pdl_flags(dev))
    return new_score, new_token, new_frontier, new_states, new_tail
