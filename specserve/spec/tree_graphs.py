"""CUDA graphs for a whole tree-drafting pass: one replay drafts every request's tree.

A pass (`TreeDrafter.expand`) is num_steps - 1 draft forwards plus the top-k bookkeeping
between them: eagerly several hundred small launches, each with its Python around it,
which cost far more than the draft's arithmetic (a one-layer head on a few rows). The pass
has fixed shapes for a given batch size (k branches per request, tails one column wider
per depth, N-1 selected nodes) and reads no host value, so one graph per batch size
captures all of it: forwards, scoring, frontier choice, tail gathers and the final rerank.

Static inputs mirror `TreeInputs`; static outputs are the trees' tokens and parents.
Replay copies a pass's inputs in place and pads the batch to the next captured size with
requests whose root children are token 0, state 0, tail_start 0, table row of the first
real request and scratch slot 0 (their K/V land in the scratch slot; their trees are
dropped). Inside the graph the attention metadata is built from device tensors
(`AttentionBackend.init_tail_metadata`), so the draft's backend must support graphs.
"""
from __future__ import annotations

import bisect

import torch

from specserve.runner.cuda_graph import capture_each, capture_sizes
from specserve.spec.drafts import ancestor_mask
from specserve.spec.tree_draft import TreeDrafter, TreeInputs


class TreeDraftGraphs:
    def __init__(self, drafter: TreeDrafter, max_bs: int, num_nodes: int, state_width: int | None,
                 state_dtype: torch.dtype, device: torch.device, capture: bool = True) -> None:
        """`capture` False runs the same padded passes eagerly (any backend, CPU tests)."""
        self.drafter, self.num_nodes = drafter, num_nodes
        self.sizes = capture_sizes(max_bs)
        n, k, steps = self.sizes[-1], drafter.topk, drafter.num_steps
        zeros = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        self.static = TreeInputs(
            first_logp=zeros(n, k, dtype=torch.float32), first_ids=zeros(n, k),
            states=zeros(n, state_width, dtype=state_dtype) if state_width else None,
            roots=zeros(n), rows=zeros(n), tail_start=zeros(n), scratch=zeros(steps - 1, n * k))
        self.capture = capture
        self.graphs, self.outputs = capture_each(self.sizes, self._pass, device) if capture else ({}, {})

    def can_run(self, bsz: int) -> bool:
        return bsz <= self.sizes[-1]

    @torch.inference_mode()
    def replay(self, x: TreeInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, parents) [B, 1 + num_selected] of `x`'s B trees and their tree masks
        [B, N, N]; valid until the next replay."""
        b, k = x.roots.shape[0], self.drafter.topk
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        st = self.static
        for static, value in ((st.first_logp, x.first_logp), (st.first_ids, x.first_ids), (st.states, x.states),
                              (st.roots, x.roots), (st.rows, x.rows), (st.tail_start, x.tail_start)):
            if static is not None:
                static[:b].copy_(value)
                if bs > b:
                    static[b:bs].zero_()
        st.scratch[:, :b * k].copy_(x.scratch)
        if bs > b:  # padding requests read through the first real row and write slot 0
            st.rows[b:bs].copy_(x.rows[:1].expand(bs - b))
            st.scratch[:, b * k:bs * k].zero_()
        if self.capture:
            self.graphs[bs].replay()
            tokens, parents, mask = self.outputs[bs]
        else:
            tokens, parents, mask = self._pass(bs)
        return tokens[:b], parents[:b], mask[:b]

    def _pass(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The trees and their masks (verify reads them: computed here, no launches of their own)."""
        tokens, parents = self.drafter.expand(self._view(bs), self.drafter.step, self.num_nodes)
        return tokens, parents, ancestor_mask(parents)

    def _view(self, bs: int) -> TreeInputs:
        st, k = self.static, self.drafter.topk
        return TreeInputs(st.first_logp[:bs], st.first_ids[:bs], st.states[:bs] if st.states is not None else None,
                          st.roots[:bs], st.rows[:bs], st.tail_start[:bs], st.scratch[:, :bs * k])
