"""The end of a tree-drafting pass in one Triton launch: keep the best candidates, number
them as tree nodes, and build the trees' ancestor masks (`spec.tree_draft._select`).

After the last depth a request has M candidates (scores, tokens, parents as candidate
indices, -1 for the root's children). The torch path keeps the n_sel best with a top-k and
a sort, renumbers parents with a scatter and two gathers, and builds the [N, N] ancestor
mask by ceil(log2 N) squarings of the parent relation: about twenty-five launches a step.
Here one program per request does all of it:
  rank[c] = #{candidates ahead of c: higher score, or equal score and lower index}
  c is kept iff rank[c] < n_sel; kept candidates become nodes 1..n_sel in candidate order
  node_tokens[0] = root, node_parents[0] = -1; a kept node's parent is its parent
  candidate's node, or the root (0) when that candidate was not kept (a tie lost)
  mask[i, j] iff j is i or an ancestor of i: walk each row's parent chain, at most
  max_depth steps (a candidate's depth is at most the pass's number of steps).
Ties go to the lower candidate index (torch.topk leaves their order unspecified).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl_flags
from specserve.kernels.pdl import wait_and_release

Trees = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # node tokens, node parents, ancestor masks (bool)
CHUNK = 64  # candidates compared at a time when ranking (keeps the [BM, CHUNK] block in registers)


@triton.jit
def _select_kernel(roots_ptr, score_ptr, token_ptr, parent_ptr, node_of_ptr, out_tok_ptr, out_par_ptr, mask_ptr,
                   M, N_SEL, MAX_DEPTH, BM: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr,
                   USE_PDL: tl.constexpr):
    wait_and_release(USE_PDL)  # the depths' scores are the kernels before's
    b = tl.program_id(0)
    n = N_SEL + 1
    c = tl.arange(0, BM)
    valid = c < M
    s = tl.load(score_ptr + b * M + c, mask=valid, other=float("-inf"))
    rank = tl.zeros([BM], dtype=tl.int32)
    for j0 in range(0, M, CH):
        j = j0 + tl.arange(0, CH)
        sj = tl.load(score_ptr + b * M + j, mask=j < M, other=float("-inf"))
        ahead = (sj[None, :] > s[:, None]) | ((sj[None, :] == s[:, None]) & (j[None, :] < c[:, None]))
        rank += tl.sum((ahead & (j < M)[None, :]).to(tl.int32), axis=1)
    kept = valid & (rank < N_SEL)
    node = tl.cumsum(kept.to(tl.int32), axis=0)  # 1-based node index of a kept candidate
    tl.store(node_of_ptr + b * BM + c, tl.where(kept, node, 0))
    tl.debug_barrier()  # node_of is read back by other threads of this program
    par = tl.load(parent_ptr + b * M + c, mask=valid, other=-1)
    par_node = tl.load(node_of_ptr + b * BM + par, mask=kept & (par >= 0), other=0)
    tl.store(out_tok_ptr + b * n + node, tl.load(token_ptr + b * M + c, mask=kept, other=0), mask=kept)
    tl.store(out_par_ptr + b * n + node, par_node.to(tl.int64), mask=kept)
    tl.store(out_tok_ptr + b * n, tl.load(roots_ptr + b))
    tl.store(out_par_ptr + b * n, -1)
    tl.debug_barrier()  # the parents just stored are walked below
    i = tl.arange(0, BN)
    live = i < n
    cur = i
    reach = i[None, :] == i[:, None]
    for _ in range(MAX_DEPTH):
        cur = tl.load(out_par_ptr + b * n + cur, mask=live & (cur >= 0), other=-1).to(tl.int32)
        reach = reach | (i[None, :] == cur[:, None])  # -1 matches no column
    tl.store(mask_ptr + b * n * n + i[:, None] * n + i[None, :], reach.to(tl.uint8),
             mask=live[:, None] & live[None, :])


def tree_select(roots: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                n_sel: int, max_depth: int, out: Trees | None = None) -> Trees:
    """roots [B], scores/tokens/parents [B, M] (float32, int64, int64) -> node tokens and
    parents [B, 1 + n_sel] int64 and the ancestor-or-self mask [B, 1 + n_sel, 1 + n_sel] bool,
    written into `out` (contiguous tensors of those shapes) when given."""
    bsz, m = scores.shape
    n, dev = n_sel + 1, scores.device
    assert 0 < n_sel <= m and max_depth >= 1
    bm = max(triton.next_power_of_2(m), 16)
    node_of = torch.empty(bsz, bm, dtype=torch.int32, device=dev)
    if out is None:
        out = (torch.empty(bsz, n, dtype=torch.int64, device=dev), torch.empty(bsz, n, dtype=torch.int64, device=dev),
               torch.empty(bsz, n, n, dtype=torch.bool, device=dev))
    assert [tuple(t.shape) for t in out] == [(bsz, n), (bsz, n), (bsz, n, n)] and all(t.is_contiguous() for t in out)
    out_tok, out_par, mask = out[0], out[1], out[2].view(torch.uint8)
    _select_kernel[(bsz,)](roots, scores.contiguous(), tokens.contiguous(), parents.contiguous(), node_of,
                           out_tok, out_par, mask, m, n_sel, max_depth, BM=bm,
                           BN=max(triton.next_power_of_2(n), 16), CH=min(CHUNK, bm), num_warps=4 if bm <= 128 else 8,
                           **pdl_flags(dev))
    return out
