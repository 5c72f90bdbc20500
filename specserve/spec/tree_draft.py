"""EAGLE-2-style tree drafting for a draft LLM (STANDALONE with topk > 1).

Step 1 (the caller's catch-up forward) gives the root's top-k children. Each later step
runs the draft on the current frontier (k branches per request) and scores every child by
its path log-probability; the global top-k of the k*k children becomes the next frontier.
At the end the best budget-1 candidates from all depths are kept (parents always outscore
their children, so the set is ancestor-closed; an orphan from a tie is dropped).

Each branch gets a scratch table row holding prefix + root + its real ancestors + itself,
so a branch's draft attention sees exactly its own ancestors (SGLang issue 7523 is the
bug this avoids), and every draft step is a plain decode batch. Scratch slots and rows
are freed before verify; verify recomputes the chosen nodes with the target.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.engine.batch import ScheduleBatch
from specserve.engine.kv_manager import KVManager
from specserve.engine.request import Req
from specserve.runner.forward_batch import ForwardMode


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


class TreeDrafter:
    def __init__(self, kv: KVManager, run, topk: int, num_steps: int) -> None:
        self.kv, self.run, self.topk, self.num_steps = kv, run, topk, num_steps

    def draft(self, reqs: list[Req], root_logits: torch.Tensor, budgets: list[int]
              ) -> list[tuple[list[int], list[int]]]:
        """Trees per request from the root's draft logits [B, V] (the catch-up forward's)."""
        k = self.topk
        cands = [Candidates() for _ in reqs]
        logp, tok = root_logits.log_softmax(-1).topk(k, dim=-1)  # [B, k]
        frontier = [[c.add(t, -1, s) for t, s in zip(tok[b].tolist(), logp[b].tolist())]
                    for b, c in enumerate(cands)]
        rows, slots = self._first_rows(reqs), []
        try:
            for depth in range(1, self.num_steps):
                step_slots = self.kv.alloc_slots(len(reqs) * k)
                slots.append(step_slots)
                logits = self._forward(reqs, cands, frontier, rows[-1], step_slots, depth)
                prev, frontier = frontier, self._expand(cands, frontier, logits)
                if depth + 1 < self.num_steps:
                    rows.append(self._next_rows(reqs, cands, prev, frontier, rows[-1], depth))
        finally:
            for s in slots:
                self.kv.allocator.free(s)
            for r in (r for step_rows in rows for r in step_rows):
                self.kv.table.free(r)
        return [c.best_tree(req.all_ids[-1], n) for c, req, n in zip(cands, reqs, budgets)]

    def _first_rows(self, reqs: list[Req]) -> list[list[int]]:
        """k scratch rows per request holding its committed prefix and the root's slot."""
        rows = [self._alloc_row() for _ in range(len(reqs) * self.topk)]
        src = [r.row for r in reqs for _ in range(self.topk)]
        width = max(r.kv_len for r in reqs) + 1
        table = self.kv.table.table
        table[rows, :width] = table[src, :width]
        return [rows]

    def _alloc_row(self) -> int:
        row = self.kv.table.alloc()
        if row is None:
            raise RuntimeError("no scratch table row for tree drafting (raise --max-running-requests' room)")
        return row

    def _forward(self, reqs, cands, frontier, rows, slots, depth: int) -> torch.Tensor:
        """Decode every frontier node (depth `depth`) on its branch row; logits [B*k, V]."""
        k = self.topk
        pos = [r.kv_len + depth for r in reqs for _ in range(k)]
        table = self.kv.table.table
        table[rows, pos] = slots.to(table.device)  # each branch row ends with its own node
        ids = [cands[b].tokens[i] for b in range(len(reqs)) for i in frontier[b]]
        batch = ScheduleBatch(ForwardMode.DECODE, [r for r in reqs for _ in range(k)], ids, slots, pos,
                              [1] * len(ids), [True] * len(ids), rows=rows)
        return self.run(batch)

    def _expand(self, cands: list[Candidates], frontier: list[list[int]], logits: torch.Tensor) -> list[list[int]]:
        """Record all k*k children; return each request's top-k of them as the next frontier."""
        k = self.topk
        logp, tok = logits.log_softmax(-1).topk(k, dim=-1)  # [B*k, k]
        logp, tok = logp.view(len(cands), k, k).tolist(), tok.view(len(cands), k, k).tolist()
        nxt = []
        for b, c in enumerate(cands):
            kids = [c.add(tok[b][j][m], f, c.scores[f] + logp[b][j][m])
                    for j, f in enumerate(frontier[b]) for m in range(k)]
            nxt.append(sorted(kids, key=lambda i: -c.scores[i])[:k])
        return nxt

    def _next_rows(self, reqs: list[Req], cands: list[Candidates], prev: list[list[int]],
                   frontier: list[list[int]], rows: list[int], depth: int) -> list[int]:
        """Branch rows for the new frontier: a copy of the parent branch's row through the
        parent's own slot (position kv_len + depth); the next forward appends the child."""
        k = self.topk
        new = [self._alloc_row() for _ in range(len(reqs) * k)]
        src = []
        for b, c in enumerate(cands):
            branch_of = {node: j for j, node in enumerate(prev[b])}
            src += [rows[b * k + branch_of[c.parents[i]]] for i in frontier[b]]
        width = max(r.kv_len for r in reqs) + depth + 1
        table = self.kv.table.table
        table[new, :width] = table[src, :width]
        return new
