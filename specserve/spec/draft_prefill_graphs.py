"""CUDA graphs for EAGLE's draft prefill: the draft extend over one request's prefill chunk.

After the target prefills a chunk (one launch: runner/prefill_graphs.py), the draft
extends the same positions with the target's features there and leaves the root state
(eagle.py `on_extend`). Eagerly that is ~40 launches behind their Python, and the
root's top-k: on an H100 an EAGLE-3 request's first token took 4.40 ms against plain
decoding's 2.11 (dummy SmolLM2, 100-token prompts, `.gpu` script), every request.

The buckets are the target's: a chunk of n tokens replays the graph of the smallest
B >= n rows. The draft runs as one causal request's EXTEND on its backend's
prefill-graph state, whose true n and prefix are device metadata (padding rows are never
queries nor keys); padding rows write their K/V to the scratch slot 0 and take feature
row 0. The root state of row n - 1 goes to the request's row of `RootStates` (a final
chunk) or to its scratch row (a middle chunk samples nothing). Every per-replay index is
in one static int64 buffer, filled by one host->device copy.
"""
from __future__ import annotations

import bisect

import torch

from specserve.runner.cuda_graph import capture_each
from specserve.runner.forward_batch import ForwardBatch, ForwardMode
from specserve.runner.prefill_graphs import prefill_sizes
from specserve.spec.root_states import RootStates
from specserve.spec.tree_draft import top_children


class DraftPrefillGraphs:
    def __init__(self, model, backend, kv_pool, req_to_token: torch.Tensor, max_tokens: int, feature_width: int,
                 topk: int, token_map: torch.Tensor | None, roots: RootStates, capture: bool = True) -> None:
        """`backend` a graph-capable one (TritonBackend: its prefill-graph state); `capture`
        False runs the same padded batches eagerly (CPU tests, the kernels interpreted)."""
        self.model, self.backend, self.kv_pool, self.table = model, backend, kv_pool, req_to_token
        self.topk, self.token_map, self.roots, self.capture = topk, token_map, roots, capture
        self.sizes = prefill_sizes(max_tokens)
        n, dev = (self.sizes[-1] if self.sizes else 0), req_to_token.device
        # ids, positions, slots [n] each, then (table row, last row, root-state row)
        self.index = torch.zeros(3 * n + 3, dtype=torch.int64, device=dev)
        self.ids, self.pos, self.slots, self.meta = self.index.split([n, n, n, 3])
        self.meta[2] = roots.scratch_row  # what capturing writes goes to the scratch row
        self.features = torch.zeros(n, feature_width, dtype=next(model.parameters()).dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        backend.init_prefill_graph_state()
        if capture and self.sizes:
            batches = {b: self._batch(b, 0, b) for b in self.sizes}
            self.graphs, _ = capture_each(self.sizes, lambda b: self._run(batches[b]), dev,
                                          prepare=lambda b: backend.init_metadata_for_capture(batches[b]))

    def can_run(self, n_tokens: int) -> bool:
        return 1 <= n_tokens <= (self.sizes[-1] if self.sizes else 0)

    @torch.inference_mode()
    def run(self, ids: list[int], start: int, slots: torch.Tensor, features: torch.Tensor, table_row: int,
            root_row: int | None) -> None:
        """Draft-extend positions [start, start + n) of table row `table_row`: `ids` [n] the
        tokens paired with them (eagle.py `extend_tokens`), `slots` [n] their KV slots (on
        the host, as the allocator hands them out), `features` [n, F] the target's; the
        root state goes to `root_row` (None: nowhere)."""
        n = len(ids)
        b = self.sizes[bisect.bisect_left(self.sizes, n)]
        big = self.ids.numel()
        host = torch.zeros(self.index.numel(), dtype=torch.int64)
        host[:n] = torch.tensor(ids, dtype=torch.int64)
        host[big:big + n] = torch.arange(start, start + n)
        host[2 * big:2 * big + n] = slots  # padding rows keep slot 0 (the scratch slot)
        host[3 * big:] = torch.tensor([table_row, n - 1, self.roots.scratch_row if root_row is None else root_row])
        self.index.copy_(host, non_blocking=True)  # pageable: staged before the call returns
        self.features[:n].copy_(features)
        fb = self._batch(b, start, n)
        self.backend.init_metadata_for_replay(fb)
        if self.capture:
            self.graphs[b].replay()
        else:
            self._run(fb)

    def _batch(self, b: int, prefix: int, n: int) -> ForwardBatch:
        """The static batch of graph size b: one request, `prefix` cached tokens, n real rows."""
        return ForwardBatch(ForwardMode.EXTEND, self.ids[:b], self.pos[:b], self.slots[:b], self.meta[0:1],
                            [prefix], [n], self.table, self.kv_pool, self.backend, logit_rows=None)

    def _run(self, fb: ForwardBatch) -> None:
        b = fb.input_ids.numel()
        h_logits, h_next = self.model(fb, self.features[:b])
        last = self.meta[1:2]
        logp, ids = top_children(self.model.compute_logits(h_logits.index_select(0, last)), self.topk,
                                 self.token_map)
        self.roots.write(self.meta[2:3], logp, ids, h_next.index_select(0, last))
