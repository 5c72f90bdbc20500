"""CUDA graphs for EAGLE's draft prefill: the draft extend over a prefill chunk's requests.

After the target prefills a chunk (one launch: runner/prefill_graphs.py), the draft
extends the same positions with the target's features there and leaves each finished
request's root state (proposer.py `on_extend`). Eagerly that is ~40 launches behind their
Python, and the roots' top-k, on every request's time to first token; one replay each.

The graphs are keyed as the target's: (tokens, requests), a chunk of n tokens over q
requests replaying the smallest bucket B >= n of one request or of `max_reqs`. The
draft runs as an EXTEND over the backend's prefill-graph state, whose true prefix and
extend lengths are device metadata: padding requests extend 0 tokens and padding rows
are never queries nor keys; padding rows write their K/V to the scratch slot 0 and take
feature row 0. The root state of each request's last row goes to its row of
`RootStates` (a final chunk) or to the scratch row (a middle chunk samples nothing, and
so do padding requests, whose last row is row 0). Every per-replay index is in one
static int64 buffer, filled by one host->device copy.
"""
from __future__ import annotations

import bisect

import torch

from specserve.core.forward_batch import ForwardBatch, ForwardMode
from specserve.models.layers import activation_dtype
from specserve.runner.cuda_graph import capture_each
from specserve.runner.prefill_graphs import MAX_REQS, prefill_sizes
from specserve.spec.tree.draft import top_children
from specserve.spec.tree.root_states import RootStates


class DraftPrefillGraphs:
    def __init__(self, model, backend, kv_pool, req_to_token: torch.Tensor, max_tokens: int, feature_width: int,
                 topk: int, token_map: torch.Tensor | None, roots: RootStates, capture: bool = True,
                 max_reqs: int = MAX_REQS) -> None:
        """`backend` a graph-capable one (TritonBackend: its prefill-graph state); `capture`
        False runs the same padded batches eagerly (CPU tests, the kernels interpreted)."""
        self.model, self.backend, self.kv_pool, self.table = model, backend, kv_pool, req_to_token
        self.topk, self.token_map, self.roots, self.capture = topk, token_map, roots, capture
        self.sizes = prefill_sizes(max_tokens)
        self.req_sizes = sorted({1, max(1, min(max_reqs, MAX_REQS))})
        n, r, dev = (self.sizes[-1] if self.sizes else 0), self.req_sizes[-1], req_to_token.device
        # ids, positions, slots [n] each, then table rows, last rows, root-state rows [r] each
        self.index = torch.zeros(3 * n + 3 * r, dtype=torch.int64, device=dev)
        self.ids, self.pos, self.slots, self.rows, self.last, self.dst = self.index.split([n, n, n, r, r, r])
        self.dst.fill_(roots.scratch_row)  # what capturing writes goes to the scratch row
        self.features = torch.zeros(n, feature_width, dtype=activation_dtype(model), device=dev)
        self.keys = [(b, q) for b in self.sizes for q in self.req_sizes]  # every pair, as the target's
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        backend.init_prefill_graph_state(r)
        if capture and self.keys:
            batches = {(b, q): self._batch(b, q, [0] * q, [b] + [0] * (q - 1)) for b, q in self.keys}
            self.graphs, _ = capture_each(self.keys, lambda key: self._run(batches[key]), dev,
                                          prepare=lambda key: backend.init_metadata_for_capture(batches[key]))

    def can_run(self, n_tokens: int, n_reqs: int = 1) -> bool:
        return 1 <= n_tokens <= (self.sizes[-1] if self.sizes else 0) and n_reqs <= self.req_sizes[-1]

    @torch.inference_mode()
    def run(self, chunks: list[tuple[list[int], int, int, int | None]], slots: torch.Tensor,
            features: torch.Tensor) -> None:
        """Draft-extend a prefill chunk: per request (ids, start, table row, root row),
        `ids` [n_i] the tokens paired with positions [start, start + n_i) (eagle.py
        `extend_tokens`) and the root row its state goes to (None: nowhere); `slots` [n]
        their KV slots, request after request (on the host, as the allocator hands them
        out), `features` [n, F] the target's there."""
        n, q = sum(len(c[0]) for c in chunks), len(chunks)
        b = self.sizes[bisect.bisect_left(self.sizes, n)]
        r = self.req_sizes[bisect.bisect_left(self.req_sizes, q)]
        big, wide = self.ids.numel(), self.rows.numel()
        host = torch.zeros(self.index.numel(), dtype=torch.int64)
        host[:n] = torch.tensor([t for ids, *_ in chunks for t in ids], dtype=torch.int64)
        host[big:big + n] = torch.cat([torch.arange(start, start + len(ids)) for ids, start, *_ in chunks])
        host[2 * big:2 * big + n] = slots  # padding rows keep slot 0 (the scratch slot)
        meta = host[3 * big:].view(3, wide)
        meta[0, :q] = torch.tensor([row for *_, row, _ in chunks])
        meta[1, :q] = torch.tensor([len(ids) for ids, *_ in chunks]).cumsum(0) - 1
        meta[2] = self.roots.scratch_row  # padding requests: row 0's state to the scratch row
        meta[2, :q] = torch.tensor([self.roots.scratch_row if root is None else root for *_, root in chunks])
        self.index.copy_(host, non_blocking=True)  # pageable: staged before the call returns
        self.features[:n].copy_(features)
        pad = r - q
        fb = self._batch(b, r, [start for _, start, *_ in chunks] + [0] * pad,
                         [len(ids) for ids, *_ in chunks] + [0] * pad)
        self.backend.init_metadata_for_replay(fb)
        if self.capture:
            self.graphs[(b, r)].replay()
        else:
            self._run(fb)

    def _batch(self, b: int, r: int, prefix_lens: list[int], extend_lens: list[int]) -> ForwardBatch:
        """The static batch of graph (b rows, r requests) with these per-request lengths."""
        return ForwardBatch(ForwardMode.EXTEND, self.ids[:b], self.pos[:b], self.slots[:b], self.rows[:r],
                            prefix_lens, extend_lens, self.table, self.kv_pool, self.backend, logit_rows=None)

    def _run(self, fb: ForwardBatch) -> None:
        b, r = fb.input_ids.numel(), fb.batch_size
        h_logits, h_next = self.model(fb, self.features[:b])
        last = self.last[:r]
        logp, ids = top_children(self.model.compute_logits(h_logits.index_select(0, last)), self.topk,
                                 self.token_map)
        self.roots.write(self.dst[:r], logp, ids, h_next.index_select(0, last))
