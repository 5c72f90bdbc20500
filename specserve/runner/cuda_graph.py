"""CUDA graphs for decode: one captured forward per batch size, replayed with fresh inputs.

A small model's eager decode step is bound by kernel launches (hundreds per token), not by
the GPU. Capturing the whole forward (embedding, layers, attention, LM head) once per
batch size turns a step into one graph launch. Graphs are keyed by (mode, batch size);
a batch is padded up to the next captured size. Only DECODE is captured so far.

Static buffers hold everything a captured forward reads: input ids, positions, output
slots and table rows of up to `max_bs` requests, plus the attention backend's own
metadata (`init_cuda_graph_state` / `init_metadata_for_capture` / `..._for_replay`).
Replay copies a batch into them in place; padded rows decode token 0 at position 0
into the scratch slot 0, reading one key through the first real row (their outputs are
dropped). All captures share one memory pool, largest batch first.
"""
from __future__ import annotations

import bisect
import logging

import torch
from tqdm import tqdm

from specserve.runner.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger("specserve")


def capture_sizes(max_bs: int) -> list[int]:
    """SGLang's ladder: 1, 2, 4, 8, then steps of 8 to 256, then of 16 (capped at max_bs)."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 8)) + list(range(272, 1025, 16))
    return [s for s in sizes if s < max_bs] + [max_bs]


class CudaGraphRunner:
    def __init__(self, model, backend, vocab_size: int, device: torch.device, max_bs: int) -> None:
        self.model, self.backend, self.device = model, backend, device
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_slots = torch.zeros(n, dtype=torch.int64, device=device)  # padding: slot 0
        self.req_rows = torch.zeros(n, dtype=torch.int64, device=device)
        self.logits = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
        backend.init_cuda_graph_state(n, 1)
        self.graphs: dict[tuple[ForwardMode, int], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, template: ForwardBatch) -> None:
        """Capture DECODE for every size; `template` supplies the table and KV pool."""
        for bs in tqdm(sorted(self.sizes, reverse=True), desc="Capturing CUDA graphs", unit="graph", leave=False):
            fb = self._static_batch(template, bs, [0] * bs)
            self.backend.init_metadata_for_capture(fb)
            for _ in range(2):  # warm up: compile kernels, settle allocator state
                self._run(fb, bs)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._run(fb, bs)
            self.graphs[(ForwardMode.DECODE, bs)] = graph
        torch.cuda.synchronize(self.device)
        logger.info("Captured CUDA graphs for decode at batch sizes %s", self.sizes)

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.mode == ForwardMode.DECODE and fb.batch_size <= self.max_bs and fb.logit_rows is not None \
            and fb.logit_rows.numel() == fb.batch_size

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] of a DECODE batch, through the graph of the next captured size."""
        b = fb.batch_size
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        self._fill(fb, b, bs)
        static = self._static_batch(fb, bs, fb.prefix_lens + [0] * (bs - b))
        self.backend.init_metadata_for_replay(static)
        self.graphs[(ForwardMode.DECODE, bs)].replay()
        return self.logits[:b]

    def _fill(self, fb: ForwardBatch, b: int, bs: int) -> None:
        self.input_ids[:b].copy_(fb.input_ids)
        self.positions[:b].copy_(fb.positions)
        self.out_slots[:b].copy_(fb.out_slots)
        self.req_rows[:b].copy_(fb.req_rows)
        if bs > b:  # padding rows: token 0 at position 0 into slot 0, reading the first real row
            self.input_ids[b:bs].zero_()
            self.positions[b:bs].zero_()
            self.out_slots[b:bs].zero_()
            self.req_rows[b:bs].copy_(fb.req_rows[:1].expand(bs - b))

    def _static_batch(self, template: ForwardBatch, bs: int, prefix_lens: list[int]) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_slots=self.out_slots[:bs], req_rows=self.req_rows[:bs], prefix_lens=prefix_lens,
            extend_lens=[1] * bs, req_to_token=template.req_to_token, kv_pool=template.kv_pool,
            attn_backend=self.backend, logit_rows=None)

    def _run(self, fb: ForwardBatch, bs: int) -> None:
        hidden, _ = self.model(fb)
        self.logits[:bs].copy_(self.model.compute_logits(hidden))
