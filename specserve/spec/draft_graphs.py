"""CUDA graphs for an EAGLE-family draft model's decode steps (the tree drafter's forwards).

Each tree-drafting step runs the draft on B*topk frontier rows, one token each, with the
incoming hidden of each row. Eagerly that is a few dozen kernel launches per step, several
steps per verify: launch-bound. Like `runner/cuda_graph.py` for the target, one graph per
row count (the same ladder, up to max_running * topk) reads static buffers: token ids,
positions, output slots, table rows, the incoming hidden, and writes draft logits and the
next hidden. Padding rows decode token 0 at position 0 into the scratch slot 0 through
the first real row; their outputs are dropped. The draft's own attention backend instance
holds its graph metadata.
"""
from __future__ import annotations

import bisect

import torch

from specserve.runner.cuda_graph import capture_sizes
from specserve.runner.forward_batch import ForwardBatch, ForwardMode


class DraftDecodeGraphs:
    def __init__(self, model, backend, kv_pool, req_to_token: torch.Tensor, max_rows: int, vocab: int) -> None:
        self.model, self.backend, self.kv_pool, self.table = model, backend, kv_pool, req_to_token
        self.sizes = capture_sizes(max_rows)
        n, dev = self.sizes[-1], req_to_token.device
        width = model.config.hidden_size
        dtype = next(p for p in model.parameters()).dtype
        self.ids, self.pos, self.slots, self.rows = (torch.zeros(n, dtype=torch.int64, device=dev) for _ in range(4))
        self.hidden_in = torch.zeros(n, width, dtype=dtype, device=dev)
        self.logits = torch.zeros(n, vocab, dtype=torch.float32, device=dev)
        self.hidden_out = torch.zeros(n, width, dtype=dtype, device=dev)
        backend.init_cuda_graph_state(n, 1)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = torch.cuda.graph_pool_handle()
        for bs in sorted(self.sizes, reverse=True):
            fb = self._batch(bs, [0] * bs)
            backend.init_metadata_for_capture(fb)
            for _ in range(2):
                self._run(fb, bs)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._run(fb, bs)
            self.graphs[bs] = graph

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.mode == ForwardMode.DECODE and fb.batch_size <= self.sizes[-1] \
            and fb.input_ids.numel() == fb.batch_size

    def replay(self, fb: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [R, V_draft], next hidden [R, H]) for a DECODE batch of R rows."""
        r = fb.batch_size
        bs = self.sizes[bisect.bisect_left(self.sizes, r)]
        for static, x in ((self.ids, fb.input_ids), (self.pos, fb.positions), (self.slots, fb.out_slots),
                          (self.rows, fb.req_rows), (self.hidden_in, hidden)):
            static[:r].copy_(x)
        if bs > r:  # padding rows: token 0 at position 0 into slot 0, through the first real row
            for static in (self.ids, self.pos, self.slots, self.hidden_in):
                static[r:bs].zero_()
            self.rows[r:bs].copy_(fb.req_rows[:1].expand(bs - r))
        self.backend.init_metadata_for_replay(self._batch(bs, fb.prefix_lens + [0] * (bs - r)))
        self.graphs[bs].replay()
        return self.logits[:r], self.hidden_out[:r]

    def _batch(self, bs: int, prefix_lens: list[int]) -> ForwardBatch:
        return ForwardBatch(ForwardMode.DECODE, self.ids[:bs], self.pos[:bs], self.slots[:bs], self.rows[:bs],
                            prefix_lens, [1] * bs, self.table, self.kv_pool, self.backend)

    def _run(self, fb: ForwardBatch, bs: int) -> None:
        h_logits, h_next = self.model(fb, self.hidden_in[:bs])
        self.logits[:bs].copy_(self.model.compute_logits(h_logits))
        self.hidden_out[:bs].copy_(h_next)
