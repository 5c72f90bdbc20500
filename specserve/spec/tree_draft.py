"""EAGLE-2 tree drafting on the device, shared by STANDALONE (topk > 1) and EAGLE / EAGLE-3 / MTP.

The caller gives the root's top-k children (from its own first forward) and a `step`
function that runs the draft on a decode batch. Each later step runs the draft on the
current frontier (k branches per request) and scores every child by its path
log-probability (SGLang multiplies probabilities: same ranking); the global top-k of the
k*k children becomes the next frontier. At the end the best N-1 candidates from all
depths are kept; no forward runs for the last depth.

Everything that depends on draft outputs (tokens, scores, parents, which branch a child
extends) stays in device tensors: a drafting pass never reads the GPU back. Only
positions, slots and table rows, which the host knows in advance, come from the host.

Candidates are numbered depth-major per request: the root's k children are 0..k-1, then
each step appends its k*k children, so a parent's index is always below its children's.
Parents outscore their children (log-probabilities are <= 0), so the best N-1 are
ancestor-closed except for exact ties; a child whose parent lost a tie hangs off the root
instead (verification is lossless for any tree, and ties are rare).

Each branch gets a scratch table row holding prefix + its real ancestors + itself, so a
branch's draft attention sees exactly its own ancestors (SGLang issue 7523 is the bug this
avoids), and every draft step is a plain decode batch. A frontier node of depth d sits at
position kv_len + d - shift: shift 0 for a draft LLM (the root's draft KV is at kv_len),
shift 1 for EAGLE (draft position p holds the pair (feature p, token p+1), so the root
pairs with position kv_len - 1 and depth-1 nodes sit at kv_len; SGLang PR 25015).
Branch states (EAGLE: the draft's hidden) follow their parents. Scratch slots and rows
are freed before verify; verify recomputes the chosen nodes with the target.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specserve.engine.batch import ScheduleBatch
from specserve.engine.kv_manager import KVManager
from specserve.engine.request import Req
from specserve.runner.forward_batch import ForwardMode
from specserve.runner.h2d import h2d, h2d_many
from specserve.spec.drafts import Drafts

# step(batch, states [R, H] or None) -> (logits [R, V_draft], next states [R, H] or None)
DraftStep = Callable[[ScheduleBatch, "torch.Tensor | None"], "tuple[torch.Tensor, torch.Tensor | None]"]


def top_children(logits: torch.Tensor, k: int, token_map: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities, target token ids), each [R, k], of the k best draft tokens."""
    logp, idx = logits.log_softmax(-1).topk(k, dim=-1)
    if token_map is not None:  # draft vocabulary (EAGLE-3 d2t, FR-Spec) -> target ids
        idx = token_map[idx]
    return logp, idx


@dataclass
class _Candidates:
    """Per request, every candidate so far: [B, M] each, M growing by k*k per step."""

    scores: list[torch.Tensor]  # path log-probabilities
    tokens: list[torch.Tensor]  # target token ids
    parents: list[torch.Tensor]  # candidate index of the parent, -1 = the root
    size: int

    def add(self, scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> int:
        """Append [B, m] candidates; return the index of the first."""
        self.scores.append(scores)
        self.tokens.append(tokens)
        self.parents.append(parents)
        first, self.size = self.size, self.size + scores.shape[1]
        return first


class TreeDrafter:
    def __init__(self, kv: KVManager, step: DraftStep, topk: int, num_steps: int, shift: int = 0,
                 token_map: torch.Tensor | None = None) -> None:
        self.kv, self.step, self.topk, self.num_steps = kv, step, topk, num_steps
        self.shift, self.token_map = shift, token_map

    @property
    def max_candidates(self) -> int:
        return self.topk + (self.num_steps - 1) * self.topk * self.topk

    def draft(self, reqs: list[Req], first: tuple[torch.Tensor, torch.Tensor], num_nodes: int,
              states: torch.Tensor | None = None) -> Drafts:
        """Trees of root + the best min(num_nodes - 1, candidates) nodes per request, on the
        device of `first` = (logp [B, k], ids [B, k]), the root's children; `states` [B, H]
        is the input state of every depth-1 node (None for a draft LLM)."""
        bsz, k = len(reqs), self.topk
        dev = first[0].device
        score, token = first
        cands = _Candidates([], [], [], 0)
        frontier = cands.add(score, token, torch.full((bsz, k), -1, dtype=torch.int64, device=dev)) \
            + torch.arange(k, device=dev).expand(bsz, k)  # [B, k] candidate indices
        if states is not None:
            states = states.repeat_interleave(k, dim=0)  # [B*k, H]: branch j of request b at b*k+j
        rows, slots = self._first_rows(reqs) if self.num_steps > 1 else ([], None), []
        try:
            for depth in range(1, self.num_steps):
                step_slots = self.kv.alloc_slots(bsz * k)
                assert step_slots is not None, "tree scratch slots were not reserved"
                slots.append(step_slots)
                logits, out_states = self._forward(reqs, token.reshape(-1), rows, step_slots, depth, states)
                logp, kid = top_children(logits, k, self.token_map)  # [B*k, k]
                kid_score = (score[:, :, None] + logp.view(bsz, k, k)).view(bsz, k * k)
                start = cands.add(kid_score, kid.view(bsz, k * k),
                                  frontier[:, :, None].expand(bsz, k, k).reshape(bsz, k * k))
                score, pick = kid_score.topk(k, dim=1)  # the next frontier: [B, k] of the k*k
                token, frontier = kid.view(bsz, k * k).gather(1, pick), start + pick
                # flat index (b*k + j) of the branch each new frontier node extends
                src = (torch.arange(bsz, device=dev)[:, None] * k + pick // k).reshape(-1)
                states = out_states[src] if out_states is not None else None
                if depth + 1 < self.num_steps:  # double-buffered: at most 2*B*k scratch rows
                    rows, old = self._next_rows(reqs, src, rows, depth), rows
                    self._free_rows(old)
        finally:
            for s in slots:
                self.kv.allocator.free(s)
            self._free_rows(rows)
        return self._select(reqs, cands, num_nodes, dev)

    def _select(self, reqs: list[Req], cands: _Candidates, num_nodes: int, dev: torch.device) -> Drafts:
        """Root + the best candidates by score, in candidate order (parents first)."""
        bsz, m = len(reqs), cands.size
        scores, tokens, parents = (torch.cat(x, dim=1) for x in (cands.scores, cands.tokens, cands.parents))
        n_sel = min(num_nodes - 1, m)
        sel = scores.topk(n_sel, dim=1).indices.sort(dim=1).values  # [B, n_sel]
        node_of = torch.zeros(bsz, m, dtype=torch.int64, device=dev)  # unselected -> the root
        node_of.scatter_(1, sel, torch.arange(1, n_sel + 1, device=dev).expand(bsz, n_sel))
        par = parents.gather(1, sel)
        par = torch.where(par < 0, 0, node_of.gather(1, par.clamp_min(0)))
        root = h2d([r.all_ids[-1] for r in reqs], dev)[:, None]
        node_tokens = torch.cat([root, tokens.gather(1, sel)], dim=1)
        node_parents = torch.cat([torch.full((bsz, 1), -1, dtype=torch.int64, device=dev), par], dim=1)
        valid = torch.ones(bsz, n_sel + 1, dtype=torch.bool, device=dev)
        return Drafts(node_tokens, node_parents, valid, [n_sel + 1] * bsz)

    # -- scratch rows: (host ids for alloc/free, device tensor for indexing) ----------------
    def _first_rows(self, reqs: list[Req]) -> tuple[list[int], torch.Tensor]:
        """k scratch rows per request holding the positions below the depth-1 nodes."""
        rows = [self._alloc_row() for _ in range(len(reqs) * self.topk)]
        width = max(r.kv_len for r in reqs) + 1 - self.shift
        table = self.kv.table.table
        dst, src = h2d_many([rows, [r.row for r in reqs for _ in range(self.topk)]], table.device)
        table[dst, :width] = table[src, :width]
        return rows, dst

    def _free_rows(self, rows: tuple[list[int], torch.Tensor | None] | list) -> None:
        for r in (rows[0] if isinstance(rows, tuple) else rows):
            self.kv.table.free(r)

    def _alloc_row(self) -> int:
        row = self.kv.table.alloc()
        if row is None:
            raise RuntimeError("no scratch table row for tree drafting (raise --max-running-requests' room)")
        return row

    def _forward(self, reqs: list[Req], ids: torch.Tensor, rows: tuple[list[int], torch.Tensor],
                 slots: torch.Tensor, depth: int, states: torch.Tensor | None):
        """Decode every frontier node (depth `depth`, token ids [B*k] on the device) on its branch row."""
        k = self.topk
        pos = [r.kv_len + depth - self.shift for r in reqs for _ in range(k)]
        table = self.kv.table.table
        dev_pos, dev_slots = h2d_many([pos, slots], table.device)
        table[rows[1], dev_pos] = dev_slots  # each branch row ends with its own node
        batch = ScheduleBatch(ForwardMode.DECODE, [r for r in reqs for _ in range(k)], ids, slots, pos,
                              [1] * len(pos), [True] * len(pos), rows=rows[0])
        return self.step(batch, states)

    def _next_rows(self, reqs: list[Req], src: torch.Tensor, rows: tuple[list[int], torch.Tensor],
                   depth: int) -> tuple[list[int], torch.Tensor]:
        """Branch rows for the new frontier: a copy of the parent branch's row through the
        parent's own slot; the next forward appends the child. `src` [B*k] on the device."""
        new = [self._alloc_row() for _ in range(len(reqs) * self.topk)]
        width = max(r.kv_len for r in reqs) + depth + 1 - self.shift
        table = self.kv.table.table
        dst = h2d(new, table.device)
        table[dst, :width] = table[rows[1][src], :width]
        return new, dst
