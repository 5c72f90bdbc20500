"""EAGLE-2 tree drafting on the device, shared by STANDALONE (topk > 1) and EAGLE / EAGLE-3 / MTP.

The caller gives the root's top-k children (from its own first forward) and a `step`
function that runs the draft on the frontier. Each later step runs the draft on the
current frontier (k branches per request) and scores every child by its path
log-probability (SGLang multiplies probabilities: same ranking); the global top-k of the
k*k children becomes the next frontier. At the end the best N-1 candidates from all
depths are kept; no forward runs for the last depth.

Everything lives in device tensors of fixed shapes (tokens, scores, parents, which branch
a child extends, slots): a drafting pass reads nothing back and launches the same kernels
for every request length, so `tree_graphs.py` captures the whole pass in one CUDA graph.

Candidates are numbered depth-major per request: the root's k children are 0..k-1, then
each step appends its k*k children, so a parent's index is always below its children's.
Parents outscore their children (log-probabilities are <= 0), so the best N-1 are
ancestor-closed except for exact ties; a child whose parent lost a tie hangs off the root
instead (verification is lossless for any tree, and ties are rare).

Attention: a branch's draft forward must see exactly its own ancestors (SGLang issue 7523
is the bug this avoids). Each branch reads the request's committed positions through the
request's own table row and its draft ancestors, then itself, from a *tail* of scratch
slots (`ForwardBatch.draft_tail`): nothing is copied into table rows. When a child is
chosen its tail is its parent branch's tail (a gather) plus its own new slot. A node of
depth d sits at position tail_start + d - 1 with tail_start = kv_len + 1 - shift: shift 0
for a draft LLM (its root KV is at kv_len), shift 1 for EAGLE (draft position p holds the
pair (feature p, token p+1), so the root pairs with kv_len - 1 and depth-1 nodes sit at
kv_len; SGLang PR 25015). Branch states (EAGLE: the draft's hidden) follow their parents.
Scratch slots are freed before verify; verify recomputes the chosen nodes with the target.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from specserve import kernels
from specserve.core.forward_batch import ForwardBatch, ForwardMode
from specserve.core.h2d import h2d_many
from specserve.core.request import Req
from specserve.engine.kv_manager import KVManager
from specserve.kernels import cpu_rows
from specserve.spec.drafts import Drafts, ancestor_mask
from specserve.spec.tree.rows import fan_out

if TYPE_CHECKING:
    from specserve.spec.tree.graphs import TreeDraftGraphs


@dataclass
class TreeStep:
    """One draft forward over the R = B*k frontier nodes of one depth (device tensors);
    branch j of request b is row b*k + j."""

    ids: torch.Tensor  # [R] token ids
    positions: torch.Tensor  # [R] tail_start + depth - 1
    out_slots: torch.Tensor  # [R] each node's scratch slot (the tail's last column)
    rows: torch.Tensor  # [R] the request's table row (positions < tail_start)
    tail_start: torch.Tensor  # [R] first position read from the tail
    tail: torch.Tensor | None  # [R, depth] slots of tail_start .. tail_start + depth - 1 (None: depth 1)
    host_tail_start: list[int] | None  # the same on the host; None inside a captured graph


# step(frontier, states) -> (logits [R, V_draft], next states): states [R, H] for a head fed
# hidden states (EAGLE), None throughout for a draft LLM (STANDALONE)
Trees = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # node tokens, node parents, ancestor masks
Candidates = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # a pass's scores, tokens, parents [B, M]
DraftStep = Callable[[TreeStep, Any], "tuple[torch.Tensor, Any]"]


@dataclass
class TreeInputs:
    """Everything one drafting pass over B requests reads, on the device."""

    first_logp: torch.Tensor  # [B, k] log-probabilities of the root's children
    first_ids: torch.Tensor  # [B, k] their target ids
    states: torch.Tensor | None  # [B, H] the input state of every depth-1 node
    roots: torch.Tensor  # [B] root token ids (node 0)
    rows: torch.Tensor  # [B] table rows
    tail_start: torch.Tensor  # [B] kv_len + 1 - shift
    scratch: torch.Tensor  # [num_steps - 1, B*k] the slot of depth d's branch b*k + j
    host_tail_start: list[int] | None = None


def frontier_batch(frame: TreeStep, req_to_token: torch.Tensor, kv_pool, backend) -> ForwardBatch:
    """The frontier as a DECODE ForwardBatch with its attention metadata built from the
    device tensors (eager or inside a graph)."""
    r = frame.ids.shape[0]
    fb = ForwardBatch(ForwardMode.DECODE, frame.ids, frame.positions, frame.out_slots, frame.rows,
                      frame.host_tail_start or [0] * r, [1] * r, req_to_token, kv_pool, backend,
                      draft_tail=frame.tail)
    backend.init_tail_metadata(fb, frame.tail_start)
    return fb


def top_children(logits: torch.Tensor, k: int, token_map: torch.Tensor | None,
                 into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities, target token ids), each [R, k], of the k best draft tokens; with
    `into` = (rows [R], logp buffer, ids buffer) also written to those rows of the buffers
    (RootStates: in the same launch on CUDA)."""
    if kernels.use_fused(logits):
        fused = kernels.topk_logprobs(logits, k, token_map, into)  # one launch instead of ~15
        if fused is not None:
            return fused
    top1 = cpu_rows.top1(logits) if k == 1 and not logits.is_cuda else None
    if top1 is not None:  # a CPU's one-draft trees: one C pass, not torch's topk and logsumexp
        logp, idx = top1
    else:
        best, idx = row_topk(logits, k) if logits.is_cuda else logits.topk(k, dim=-1)  # a CPU needs no blocks
        logp = best.float() - logits.float().logsumexp(-1, keepdim=True)  # no [R, V] log_softmax written
    if token_map is not None:  # draft vocabulary (EAGLE-3 d2t, FR-Spec) -> target ids
        idx = token_map[idx]
    if into is not None:
        into[1].index_copy_(0, into[0], logp)
        into[2].index_copy_(0, into[0], idx)
    return logp, idx


def row_topk(x: torch.Tensor, k: int, chunks: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k) over the last dim of [R, V] rows, in two stages for long rows.

    With few rows torch.topk runs one thread block per row, so a long row (a 16k draft
    vocabulary) is slow at batch 1 and, inside a CUDA graph, at 64 rows too. Cutting each
    row into `chunks` pieces gives R * chunks short rows for the first top-k and R rows of
    chunks * k candidates for the second: the same k best (ties in either order), with
    enough blocks to fill the GPU."""
    r, v = x.shape
    if v < 32 * chunks or k > v // chunks:
        return x.topk(k, dim=-1)
    piece = -(-v // chunks)
    if piece * chunks != v:  # pad with -inf to whole pieces (never among the k best: k <= v)
        x = torch.nn.functional.pad(x, (0, piece * chunks - v), value=float("-inf"))
    vals, idx = x.reshape(r, chunks, piece).topk(k, dim=-1)  # [R, C, k]
    idx = idx + torch.arange(0, piece * chunks, piece, device=x.device)[:, None]
    best, pick = vals.reshape(r, chunks * k).topk(k, dim=-1)
    return best, idx.reshape(r, chunks * k).gather(1, pick)


class TreeDrafter:
    def __init__(self, kv: KVManager, step: DraftStep, topk: int, num_steps: int, shift: int = 0,
                 token_map: torch.Tensor | None = None) -> None:
        self.kv, self.step, self.topk, self.num_steps = kv, step, topk, num_steps
        self.shift, self.token_map = shift, token_map
        self.graphs: TreeDraftGraphs | None = None  # set by a proposer that captured one
        self._starts: torch.Tensor | None = None  # see precompute

    def precompute(self, max_bs: int, device: torch.device) -> None:
        """Build the constant a pass of up to max_bs requests starts from (the first
        frontier, 0..k-1 per request) once, outside any capture, so a captured pass reads
        it instead of launching a fill."""
        self._starts = self._build_starts(max_bs, device)

    def _build_starts(self, bsz: int, dev: torch.device) -> torch.Tensor:
        return torch.arange(self.topk, device=dev).repeat(bsz, 1)

    def _first_frontier(self, bsz: int, dev: torch.device) -> torch.Tensor:
        """[B, k] the first frontier's candidate indices, 0..k-1 per request: read only."""
        if self._starts is not None and self._starts.shape[0] >= bsz and self._starts.device == dev:
            return self._starts[:bsz]
        return self._build_starts(bsz, dev)

    @property
    def max_candidates(self) -> int:
        return self.topk + (self.num_steps - 1) * self.topk * self.topk

    def num_selected(self, num_nodes: int) -> int:
        """Drafted nodes per tree (the root excluded)."""
        return min(num_nodes - 1, self.max_candidates)

    def graphed(self, bsz: int) -> bool:
        """Whether a pass over `bsz` requests replays a captured graph (which reads the
        root states itself, so the caller need not gather them)."""
        return self.graphs is not None and self.graphs.can_run(bsz)

    def draft(self, reqs: list[Req], num_nodes: int, first: tuple[torch.Tensor, torch.Tensor] | None = None,
              states: torch.Tensor | None = None) -> Drafts:
        """Trees of root + the best num_selected(num_nodes) nodes per request. `first` =
        (logp [B, k], ids [B, k]) are the root's children and `states` [B, H] the input
        state of every depth-1 node (None for a draft LLM); with a captured graph for the
        batch size both are read from the graph's RootStates instead (None here)."""
        bsz = len(reqs)
        scratch = self.kv.alloc_slots(bsz * self.topk * (self.num_steps - 1))
        assert scratch is not None, "tree scratch slots were not reserved"
        try:
            start = [r.kv_len + 1 - self.shift for r in reqs]
            root_ids, rows_host = [r.last_id for r in reqs], [r.row for r in reqs]
            if self.graphs is not None and self.graphed(bsz):
                tokens, parents, mask = self.graphs.replay_host(root_ids, rows_host, start, scratch)
            elif self.num_steps == 1 and first is not None and not kernels.use_fused(first[0]):
                return _one_depth(root_ids, first[1], self.num_selected(num_nodes))
            else:
                assert first is not None, "an eager drafting pass needs the root's children"
                roots, rows, tail_start, slots = h2d_many([root_ids, rows_host, start, scratch], first[0].device)
                x = TreeInputs(first[0], first[1], states, roots, rows, tail_start,
                               slots.view(self.num_steps - 1, bsz * self.topk), start)
                tokens, parents, mask = self.expand(x, self.step, num_nodes)
        finally:
            self.kv.allocator.free(scratch)
        return _full_trees(tokens, parents, mask)

    def draft_ahead(self, reqs: list[Req], roots: torch.Tensor, kv_lens: torch.Tensor) -> Drafts | None:
        """draft() through the captured graph for requests whose root tokens and kv lengths
        [B] exist on the device only: the step that committed them is not read back yet.
        None when the scratch slots are not free (the caller drafts later instead)."""
        bsz = len(reqs)
        scratch = self.kv.alloc_slots(bsz * self.topk * (self.num_steps - 1))
        if scratch is None:
            return None
        assert self.graphs is not None, "drafting ahead replays the captured pass"
        try:  # freed at once: whatever reuses the slots is queued behind this pass
            tokens, parents, mask = self.graphs.replay_device(roots, [r.row for r in reqs],
                                                              kv_lens + 1 - self.shift, scratch)
        finally:
            self.kv.allocator.free(scratch)
        return _full_trees(tokens, parents, mask)

    def expand(self, x: TreeInputs, step: DraftStep, num_nodes: int, out: Trees | None = None) -> Trees:
        """(tokens, parents) [B, N] and ancestor masks [B, N, N] of the trees (N = 1 +
        num_selected), with device ops only; written into `out` when given."""
        k = self.topk
        bsz, dev = x.first_logp.shape[0], x.first_logp.device
        score, token = x.first_logp, x.first_ids
        frontier = self._first_frontier(bsz, dev)  # [B, k] candidate indices
        cand = _candidates(bsz, self.max_candidates, dev)  # every depth writes its columns
        if self.num_steps == 1:  # no depth writes the root's children
            _write_first(cand, score, token)
        # per branch b*k + j: table rows, tail starts, depth d's positions at row d - 1 ([num_steps - 1,
        # B*k]) and the depth-1 input states [B*k, H]: one launch on CUDA
        rows, tail_start, positions, states = fan_out(x.rows, x.tail_start, x.states, k, max(self.num_steps - 1, 1))
        host_start = [s for s in x.host_tail_start for _ in range(k)] if x.host_tail_start is not None else None
        # [B*k, depth]: ancestors' slots, then the node's own (no scratch: one step, no forward)
        tail = x.scratch[0][:, None] if self.num_steps > 1 else None
        size = k
        for depth in range(1, self.num_steps):
            frame = TreeStep(token.reshape(-1), positions[depth - 1], x.scratch[depth - 1], rows, tail_start,
                             tail, host_start)
            logits, out_states = step(frame, states)
            logp, kid = top_children(logits, k, self.token_map)  # [B*k, k]
            next_slots = x.scratch[depth] if depth + 1 < self.num_steps else None  # None: no later forward
            score, token, frontier, states, tail = _advance(score, logp, kid, frontier, size, out_states, tail,
                                                            next_slots, cand, token if depth == 1 else None)
            size += k * k
        return _select(x.roots, *cand, self.num_selected(num_nodes), self.num_steps, out)


def _candidates(bsz: int, m: int, dev: torch.device) -> Candidates:
    """A pass's candidate buffers [B, M]: path scores (float32), tokens and parents (int64,
    candidate indices, -1 for the root's children), filled depth by depth."""
    return (torch.empty(bsz, m, dtype=torch.float32, device=dev), torch.empty(bsz, m, dtype=torch.int64, device=dev),
            torch.empty(bsz, m, dtype=torch.int64, device=dev))


def _write_first(cand: Candidates, score: torch.Tensor, tokens: torch.Tensor) -> None:
    """Columns 0..k-1 of the candidate buffers: the root's children (score, tokens [B, k],
    parent -1), with torch ops (the frontier kernel writes them at the first depth)."""
    k = score.shape[1]
    for buf, value in zip(cand, (score, tokens)):
        buf[:, :k] = value
    cand[2][:, :k] = -1


def _advance(score: torch.Tensor, logp: torch.Tensor, kid: torch.Tensor, frontier: torch.Tensor, size: int,
             states: torch.Tensor | None, tail: torch.Tensor | None, next_slots: torch.Tensor | None, cand: Candidates,
             first_tokens: torch.Tensor | None) -> tuple:
    """One depth's bookkeeping after its draft forward: the k*k children's path scores,
    tokens and parents into columns size.. of the candidate buffers `cand` (and at the
    first depth, `first_tokens` given, the root's children into columns 0..k-1: score,
    first_tokens, -1); returns the next frontier's scores, tokens and candidate indices
    [B, k] each, and (unless next_slots is None: the last depth) each chosen child's
    branch state [B*k, H] and tail [B*k, depth + 1] (its parent branch's, then its next
    slot). One launch on CUDA (kernels/frontier.py); these torch ops are its reference."""
    if kernels.use_fused(score):
        return kernels.tree_frontier(score, logp, kid, frontier, size, states, tail if next_slots is not None else None,
                                     next_slots, cand, first_tokens)
    bsz, k = score.shape
    kid_score = (score[:, :, None] + logp.view(bsz, k, k)).view(bsz, k * k)
    parents = frontier[:, :, None].expand(bsz, k, k).reshape(bsz, k * k)
    for buf, value in zip(cand, (kid_score, kid.view(bsz, k * k), parents)):
        buf[:, size:size + k * k] = value
    if first_tokens is not None:
        _write_first(cand, score, first_tokens)
    new_score, pick = kid_score.topk(k, dim=1)  # the next frontier: [B, k] of the k*k
    new_token = kid.view(bsz, k * k).gather(1, pick)
    if next_slots is None:
        return new_score, new_token, size + pick, None, None
    # flat index (b*k + j) of the branch each new frontier node extends
    src = (torch.arange(bsz, device=score.device)[:, None] * k + pick // k).reshape(-1)
    states = states[src] if states is not None else None
    assert tail is not None, "a depth with a later forward has a tail"
    tail = torch.cat([tail[src], next_slots[:, None]], dim=1)
    return new_score, new_token, size + pick, states, tail


def _one_depth(roots: list[int], ids: torch.Tensor, n_sel: int) -> Drafts:
    """A one-depth pass's trees without torch's selection ops (CPU tensors): the root and
    its n_sel best children, which `first` holds in score order, every child's parent the
    root. `_select` keeps the same children in candidate order, the same order."""
    bsz = len(roots)
    tokens = torch.cat([torch.tensor(roots, dtype=torch.int64)[:, None], ids[:, :n_sel].to(torch.int64)], dim=1)
    parents = torch.tensor([[-1] + [0] * n_sel] * bsz, dtype=torch.int64)
    mask = torch.eye(n_sel + 1, dtype=torch.bool).repeat(bsz, 1, 1)  # each node sees itself
    mask[:, :, 0] = True  # and the root: ancestor_mask(parents) without its pass
    return _full_trees(tokens, parents, mask)


def _full_trees(tokens: torch.Tensor, parents: torch.Tensor, mask: torch.Tensor) -> Drafts:
    bsz, n = tokens.shape
    return Drafts(tokens, parents, torch.ones(bsz, n, dtype=torch.bool, device=tokens.device), [n] * bsz, mask)


def _select(roots: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
            n_sel: int, max_depth: int, out: Trees | None = None) -> Trees:
    """Root + the best n_sel candidates by score, in candidate order (parents first):
    (tokens, parents) [B, 1 + n_sel] with node indices for parents (-1 for the root), and
    the trees' ancestor masks, written into `out` when given. One launch on CUDA
    (kernels/node_select.py); these torch ops are its reference. No candidate is deeper
    than max_depth."""
    if kernels.use_fused(scores):
        return kernels.tree_select(roots, scores, tokens, parents, n_sel, max_depth, out)
    trees = _select_torch(roots, scores, tokens, parents, n_sel)
    if out is None:
        return trees
    for dst, src in zip(out, trees):
        dst.copy_(src)
    return out


def _select_torch(roots: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                  n_sel: int) -> Trees:
    bsz, m = scores.shape
    dev = scores.device
    sel = scores.topk(n_sel, dim=1).indices.sort(dim=1).values  # [B, n_sel]
    node_of = torch.zeros(bsz, m, dtype=torch.int64, device=dev)  # unselected -> the root
    node_of.scatter_(1, sel, torch.arange(1, n_sel + 1, device=dev).expand(bsz, n_sel))
    par = parents.gather(1, sel)
    par = torch.where(par < 0, 0, node_of.gather(1, par.clamp_min(0)))
    node_tokens = torch.cat([roots[:, None], tokens.gather(1, sel)], dim=1)
    node_parents = torch.cat([torch.full((bsz, 1), -1, dtype=torch.int64, device=dev), par], dim=1)
    return node_tokens, node_parents, ancestor_mask(node_parents)
