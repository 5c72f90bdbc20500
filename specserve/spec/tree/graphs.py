"""CUDA graphs for a whole tree-drafting pass: one replay drafts every request's tree.

A pass (`TreeDrafter.expand`) is num_steps - 1 draft forwards plus the top-k bookkeeping
between them: eagerly several hundred small launches, each with its Python around it,
which cost far more than the draft's arithmetic (a one-layer head on a few rows). The pass
has fixed shapes for a given batch size (k branches per request, tails one column wider
per depth, N-1 selected nodes) and reads no host value, so one graph per batch size
captures all of it: the root states' gather from `RootStates`, forwards, scoring,
frontier choice, tail gathers, the final rerank and the trees' masks.

Static inputs are the requests' root tokens, table rows, tail starts and scratch slots,
in one flat buffer that a replay fills with one host->device copy; static outputs are the
trees' tokens, parents and masks. A batch is padded to the next captured size with
requests of root token 0, tail_start 0, the first real request's table row (whose root
state they read) and scratch slot 0 (their K/V land in the scratch slot; their trees are
dropped). Inside the graph the attention metadata is built from device tensors
(`AttentionBackend.init_tail_metadata`), so the draft's backend must support graphs.
"""
from __future__ import annotations

import bisect

import torch

from specserve.runner.cuda_graph import capture_each, capture_sizes
from specserve.spec.tree.draft import TreeDrafter, TreeInputs, Trees
from specserve.spec.tree.root_states import RootState, RootStates


class TreeDraftGraphs:
    def __init__(self, drafter: TreeDrafter, roots: RootStates, max_bs: int, num_nodes: int,
                 device: torch.device, capture: bool = True) -> None:
        """`capture` False runs the same padded passes eagerly (any backend, CPU tests)."""
        self.drafter, self.roots, self.num_nodes = drafter, roots, num_nodes
        self.sizes = capture_sizes(max_bs)
        n, k, steps = self.sizes[-1], drafter.topk, drafter.num_steps
        self._parts = [n, n, n, (steps - 1) * n * k]  # root tokens, table rows, tail starts, scratch
        self.index = torch.zeros(sum(self._parts), dtype=torch.int64, device=device)
        self.root_ids, self.rows, self.tail_start, scratch = self.index.split(self._parts)
        self.scratch = scratch.view(steps - 1, n * k)
        self.capture = capture
        drafter.precompute(n, device)
        self.graphs, self.outputs = capture_each(self.sizes, self._pass, device) if capture else ({}, {})

    def can_run(self, bsz: int) -> bool:
        return bsz <= self.sizes[-1]

    @torch.inference_mode()
    def replay_host(self, root_ids: list[int], rows: list[int], tail_start: list[int], scratch: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, parents) [B, 1 + num_selected] of B trees and their tree masks [B, N, N],
        valid until the next replay; `scratch` [(num_steps - 1) * B * k] CPU slots."""
        b = len(rows)
        self.index.copy_(self._host_index(root_ids, rows, tail_start, scratch), non_blocking=True)
        return self._replay(b)

    @torch.inference_mode()
    def replay_device(self, root_ids: torch.Tensor, rows: list[int], tail_start: torch.Tensor,
                      scratch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """replay_host with root tokens and tail starts [B] that exist on the device only
        (committed by a step not read back yet): two device copies after the host's one."""
        b = len(rows)
        self.index.copy_(self._host_index([0] * b, rows, [0] * b, scratch), non_blocking=True)
        self.root_ids[:b].copy_(root_ids)
        self.tail_start[:b].copy_(tail_start)
        return self._replay(b)

    def run_inline(self, roots: torch.Tensor, rows: torch.Tensor, tail_start: torch.Tensor, scratch: torch.Tensor,
                   out: Trees | None = None, states: RootState | None = None) -> Trees:
        """A pass over exactly B requests (no padding) from device tensors, without a
        replay of its own, so a caller's CUDA graph can hold it (spec/eagle/step_graphs.py):
        roots, rows and tail starts [B], scratch [num_steps - 1, B*k] slots, read where
        they are (a copy into the static inputs would be four launches more). The trees
        go into `out` when given (the caller's static buffers: no copies after); `states`
        are the rows' root states when the caller has them in hand (else gathered)."""
        return self._expand(roots, rows, tail_start, scratch, out, states)

    def _host_index(self, root_ids: list[int], rows: list[int], tail_start: list[int],
                    scratch: torch.Tensor) -> torch.Tensor:
        """The flat index buffer's host image; padding requests (up to the captured size)
        have root token 0, tail start 0, the first real row and scratch slot 0."""
        b, k, n = len(rows), self.drafter.topk, self.sizes[-1]
        bs = self._size_for(b)
        host = torch.zeros(self.index.numel(), dtype=torch.int64)
        host[:b] = torch.tensor(root_ids)
        host[n:n + bs] = torch.tensor(rows + rows[:1] * (bs - b))  # padding reads the first real row
        host[2 * n:2 * n + b] = torch.tensor(tail_start)
        host[3 * n:].view(self.drafter.num_steps - 1, n * k)[:, :b * k] = scratch.view(-1, b * k)
        return host  # pageable: a non_blocking copy is staged before the call returns

    def _size_for(self, b: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, b)]

    def _replay(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bs = self._size_for(b)
        if self.capture:
            self.graphs[bs].replay()
            tokens, parents, mask = self.outputs[bs]
        else:
            tokens, parents, mask = self._pass(bs)
        return tokens[:b], parents[:b], mask[:b]

    def _pass(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The trees and their masks (verify reads them: computed here, no launches of their own)."""
        return self._expand(self.root_ids[:bs], self.rows[:bs], self.tail_start[:bs],
                            self.scratch[:, :bs * self.drafter.topk])

    def _expand(self, roots: torch.Tensor, rows: torch.Tensor, tail_start: torch.Tensor, scratch: torch.Tensor,
                out: Trees | None = None, root_states: RootState | None = None) -> Trees:
        logp, ids, states = root_states if root_states is not None else self.roots.get(rows)
        k = self.drafter.topk  # a batch tree may branch less than the root states hold (sorted best first)
        x = TreeInputs(logp[:, :k], ids[:, :k], states, roots, rows, tail_start, scratch)
        return self.drafter.expand(x, self.drafter.step, self.num_nodes, out)
