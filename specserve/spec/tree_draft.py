"""EAGLE-2 tree drafting, shared by STANDALONE (topk > 1) and EAGLE / EAGLE-3 / MTP.

The caller gives the root's top-k children (from its own first forward) and a `step`
function that runs the draft on a decode batch. Each later step runs the draft on the
current frontier (k branches per request) and scores every child by its path
log-probability (SGLang multiplies probabilities: same ranking); the global top-k of the
k*k children becomes the next frontier. At the end the best budget-1 candidates from all
depths are kept (parents always outscore their children, so the set is ancestor-closed;
an orphan from a tie is dropped). No forward runs for the last depth.

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

from dataclasses import dataclass, field
from typing import Callable

import torch

from specserve.engine.batch import ScheduleBatch
from specserve.engine.kv_manager import KVManager
from specserve.engine.request import Req
from specserve.runner.forward_batch import ForwardMode

# step(batch, states [R, H] or None) -> (logits [R, V_draft], next states [R, H] or None)
DraftStep = Callable[[ScheduleBatch, "torch.Tensor | None"], "tuple[torch.Tensor, torch.Tensor | None]"]


@dataclass
class Candidates:
    """One request's candidate nodes; index i's parent is parents[i] (-1 = the root)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # path log-probabilities

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        return len(self.tokens) - 1

    def best_tree(self, root: int, budget: int) -> tuple[list[int], list[int]]:
        """(tokens, parents) of the root + the best budget-1 candidates, parents first."""
        order = sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], i))[:budget - 1]
        keep = sorted(order)  # candidate indices are depth-major: parents precede children
        node_of = {}
        tokens, parents = [root], [-1]
        for i in keep:
            p = self.parents[i]
            if p != -1 and p not in node_of:
                continue  # orphan (score tie with its parent cut): drop it
            node_of[i] = len(tokens)
            tokens.append(self.tokens[i])
            parents.append(0 if p == -1 else node_of[p])
        return tokens, parents


def top_children(logits: torch.Tensor, k: int, token_map: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities, target token ids), each [R, k], of the k best draft tokens."""
    logp, idx = logits.log_softmax(-1).topk(k, dim=-1)
    if token_map is not None:  # draft vocabulary (EAGLE-3 d2t, FR-Spec) -> target ids
        idx = token_map[idx]
    return logp, idx


class TreeDrafter:
    def __init__(self, kv: KVManager, step: DraftStep, topk: int, num_steps: int, shift: int = 0,
                 token_map: torch.Tensor | None = None) -> None:
        self.kv, self.step, self.topk, self.num_steps = kv, step, topk, num_steps
        self.shift, self.token_map = shift, token_map

    def draft(self, reqs: list[Req], first: tuple[torch.Tensor, torch.Tensor], budgets: list[int],
              states: torch.Tensor | None = None) -> list[tuple[list[int], list[int]]]:
        """Trees per request from the root's children `first` = (logp [B, k], ids [B, k]);
        `states` [B, H] is the input state of every depth-1 node (None for a draft LLM)."""
        k = self.topk
        cands = [Candidates() for _ in reqs]
        logp, tok = first[0].tolist(), first[1].tolist()
        frontier = [[c.add(t, -1, s) for t, s in zip(tok[b], logp[b])] for b, c in enumerate(cands)]
        if states is not None:
            states = states.repeat_interleave(k, dim=0)  # [B*k, H]: branch j of request b at b*k+j
        rows, slots = self._first_rows(reqs) if self.num_steps > 1 else [], []
        try:
            for depth in range(1, self.num_steps):
                step_slots = self.kv.alloc_slots(len(reqs) * k)
                assert step_slots is not None, "tree scratch slots were not reserved"
                slots.append(step_slots)
                logits, out_states = self._forward(reqs, cands, frontier, rows, step_slots, depth, states)
                prev, frontier = frontier, self._expand(cands, frontier, logits)
                src = self._parent_branches(cands, prev, frontier)
                states = out_states[src] if out_states is not None else None
                if depth + 1 < self.num_steps:  # double-buffered: at most 2*B*k scratch rows
                    rows, old = self._next_rows(reqs, src, rows, depth), rows
                    self._free_rows(old)
        finally:
            for s in slots:
                self.kv.allocator.free(s)
            self._free_rows(rows)
        return [c.best_tree(req.all_ids[-1], n) for c, req, n in zip(cands, reqs, budgets)]

    def _first_rows(self, reqs: list[Req]) -> list[int]:
        """k scratch rows per request holding the positions below the depth-1 nodes."""
        rows = [self._alloc_row() for _ in range(len(reqs) * self.topk)]
        src = [r.row for r in reqs for _ in range(self.topk)]
        width = max(r.kv_len for r in reqs) + 1 - self.shift
        table = self.kv.table.table
        table[rows, :width] = table[src, :width]
        return rows

    def _free_rows(self, rows: list[int]) -> None:
        for r in rows:
            self.kv.table.free(r)

    def _alloc_row(self) -> int:
        row = self.kv.table.alloc()
        if row is None:
            raise RuntimeError("no scratch table row for tree drafting (raise --max-running-requests' room)")
        return row

    def _forward(self, reqs, cands, frontier, rows, slots, depth: int, states):
        """Decode every frontier node (depth `depth`) on its branch row."""
        k = self.topk
        pos = [r.kv_len + depth - self.shift for r in reqs for _ in range(k)]
        table = self.kv.table.table
        table[rows, pos] = slots.to(table.device)  # each branch row ends with its own node
        ids = [cands[b].tokens[i] for b in range(len(reqs)) for i in frontier[b]]
        batch = ScheduleBatch(ForwardMode.DECODE, [r for r in reqs for _ in range(k)], ids, slots, pos,
                              [1] * len(ids), [True] * len(ids), rows=rows)
        return self.step(batch, states)

    def _expand(self, cands: list[Candidates], frontier: list[list[int]], logits: torch.Tensor) -> list[list[int]]:
        """Record all k*k children; return each request's top-k of them as the next frontier."""
        k = self.topk
        logp, tok = top_children(logits, k, self.token_map)  # [B*k, k]
        logp, tok = logp.view(len(cands), k, k).tolist(), tok.view(len(cands), k, k).tolist()
        nxt = []
        for b, c in enumerate(cands):
            kids = [c.add(tok[b][j][m], f, c.scores[f] + logp[b][j][m])
                    for j, f in enumerate(frontier[b]) for m in range(k)]
            nxt.append(sorted(kids, key=lambda i: -c.scores[i])[:k])
        return nxt

    def _parent_branches(self, cands: list[Candidates], prev: list[list[int]],
                         frontier: list[list[int]]) -> list[int]:
        """For each new frontier node (flat, b*k + m), the flat index of its parent's branch."""
        k, src = self.topk, []
        for b, c in enumerate(cands):
            branch_of = {node: j for j, node in enumerate(prev[b])}
            src += [b * k + branch_of[c.parents[i]] for i in frontier[b]]
        return src

    def _next_rows(self, reqs: list[Req], src: list[int], rows: list[int], depth: int) -> list[int]:
        """Branch rows for the new frontier: a copy of the parent branch's row through the
        parent's own slot; the next forward appends the child."""
        new = [self._alloc_row() for _ in range(len(reqs) * self.topk)]
        width = max(r.kv_len for r in reqs) + depth + 1 - self.shift
        table = self.kv.table.table
        table[new, :width] = table[[rows[i] for i in src], :width]
        return new
