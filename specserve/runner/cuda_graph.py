"""CUDA graphs: one captured forward per (mode, batch size), replayed with fresh inputs.

A small model's eager step is bound by kernel launches (hundreds per token), not by the
GPU. Capturing the whole forward (embedding, layers, attention, LM head) once per batch
size turns a step into one graph launch. Graphs are keyed by (mode, batch size); a batch
is padded up to the next captured size. Modes:
  * DECODE: one token per request;
  * VERIFY (when speculation is on): exactly N tree nodes per request (the caller pads
    ragged trees to N), with the tree masks and, for EAGLE, the target features.
Drafts capture their own (spec/tree/extend_graphs.py, tree_graphs.py, step_graphs.py); a
STANDALONE draft LLM's chain DECODEs use a runner of this class over its own KV pool.

Static buffers hold everything a captured forward reads: input ids, positions, output
slots and table rows, plus the attention backend's own metadata (`init_cuda_graph_state`
/ `init_metadata_for_capture` / `..._for_replay`). Replay copies a batch into them in
place. Padding requests decode token 0 at position 0 into the scratch slot 0, reading
through the first real row (their outputs are dropped). All captures share one memory
pool, largest batch first.
"""
from __future__ import annotations

import bisect
import gc
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
from tqdm import tqdm

from specserve.core.forward_batch import ForwardBatch, ForwardMode
from specserve.models.layers import activation_dtype

if TYPE_CHECKING:
    from _typeshed import SupportsRichComparison

logger = logging.getLogger("specserve")


def capture_sizes(max_bs: int) -> list[int]:
    """SGLang's ladder: 1, 2, 4, 8, then steps of 8 to 256, then of 16 (capped at max_bs)."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 8)) + list(range(272, 1025, 16))
    return [s for s in sizes if s < max_bs] + [max_bs]


T = TypeVar("T")
K = TypeVar("K", bound="SupportsRichComparison")  # a graph's key: a batch size, or a tuple of sizes


@contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool) -> Iterator[None]:
    """torch.cuda.graph with Python's garbage collector held off for the capture. A
    collection inside it may destroy CUDA objects that earlier work left unreferenced
    (graphs, events, pinned buffers of an engine built before), a call a capture forbids:
    the capture is invalidated (an intermittent cudaErrorStreamCaptureInvalidated, e.g.
    when one process builds engines one after another). SGLang freezes GC while capturing too.
    torch.cuda.graph still collects once before the capture begins."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if enabled:
            gc.enable()


def capture_each(sizes: list[K], body: Callable[[K], T], device: torch.device,
                 prepare: Callable[[K], None] | None = None, desc: str | None = None, pool=None
                 ) -> tuple[dict[K, torch.cuda.CUDAGraph], dict[K, T]]:
    """One graph per size, largest first, in one memory pool (`pool`, or a new one):
    `prepare(bs)` (outside the capture: metadata copies), `body(bs)` twice (compile kernels,
    settle the allocator), then `body(bs)` captured. Returns the graphs and what each
    captured call returned (its outputs: static tensors that every replay rewrites).
    `desc`: a progress bar's label. Every CUDA graph in specserve is captured here."""
    graphs: dict[K, torch.cuda.CUDAGraph] = {}
    outputs: dict[K, T] = {}
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    order = sorted(sizes, reverse=True)
    for bs in (tqdm(order, desc=desc, unit="graph", leave=False) if desc else order):
        if prepare is not None:
            prepare(bs)
        for _ in range(2):
            body(bs)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, pool):
            outputs[bs] = body(bs)
        graphs[bs] = graph
    return graphs, outputs


def pad_device_prefix(prefix: torch.Tensor | None, bs: int) -> torch.Tensor | None:
    """[b] device prefix lengths padded with zeros to a captured size bs (padding requests sit at position 0)."""
    if prefix is None or prefix.numel() == bs:
        return prefix
    return torch.cat([prefix, prefix.new_zeros(bs - prefix.numel())])


@dataclass
class _Static:
    """One mode's input and output buffers, sized for max_bs requests of `tokens` each."""

    tokens: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor  # padding: slot 0
    req_rows: torch.Tensor
    logits: torch.Tensor
    features: torch.Tensor | None


class CudaGraphRunner:
    def __init__(self, model, backend, vocab_size: int, device: torch.device, max_bs: int,
                 verify_tokens: int = 0, feature_mode: str | None = None) -> None:
        self.model, self.backend, self.device = model, backend, device
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.feature_mode = feature_mode
        # DECODE keeps features too: a speculative step turned down to plain decoding is a
        # decode whose features the draft still needs (spec/governor.py).
        self.static = {ForwardMode.DECODE: self._buffers(1, vocab_size, feature_mode)}
        backend.init_cuda_graph_state(self.max_bs, 1)
        if verify_tokens > 1:
            self.static[ForwardMode.VERIFY] = self._buffers(verify_tokens, vocab_size, feature_mode)
            backend.init_cuda_graph_state(self.max_bs, verify_tokens)
        self.graphs: dict[tuple[ForwardMode, int], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _buffers(self, tokens: int, vocab: int, feature_mode: str | None) -> _Static:
        n, dev = self.max_bs * tokens, self.device
        c = self.model.config
        width = c.hidden_size * (len(self.model.aux_layers) if feature_mode == "aux" else 1)
        zeros = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        features = zeros(n, width, dtype=activation_dtype(self.model)) if feature_mode else None
        return _Static(tokens, zeros(n), zeros(n), zeros(n), zeros(self.max_bs),
                       zeros(n, vocab, dtype=torch.float32), features)

    def capture(self, template: ForwardBatch) -> None:
        """Capture every mode at every size; `template` supplies the table and KV pool."""
        for mode, st in self.static.items():
            batches: dict[int, ForwardBatch] = {}

            def prepare(bs: int, mode: ForwardMode = mode, batches: dict = batches) -> None:
                batches[bs] = self._static_batch(template, mode, bs, [0] * bs, None)
                self.backend.init_metadata_for_capture(batches[bs])

            def run(bs: int, st: _Static = st, batches: dict = batches) -> None:
                self._run(batches[bs], st, bs)

            graphs, _ = capture_each(self.sizes, run, self.device,
                                     prepare=prepare, desc=f"Capturing {mode.value} graphs", pool=self.pool)
            self.graphs.update({(mode, bs): g for bs, g in graphs.items()})
        torch.cuda.synchronize(self.device)
        logger.info("Captured CUDA graphs for %s at batch sizes %s",
                    ", ".join(m.value for m in self.static), self.sizes)

    def can_run(self, fb: ForwardBatch) -> bool:
        st = self.static.get(fb.mode)
        if st is None or fb.batch_size > self.max_bs or fb.logit_rows is None:
            return False
        return all(n == st.tokens for n in fb.extend_lens) and fb.logit_rows.numel() == fb.input_ids.numel()

    def replay(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [T, V], features [T, F] or None) through the graph of the next captured size."""
        st, b = self.static[fb.mode], fb.batch_size
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        self._fill(fb, st, b, bs)
        masks = fb.custom_masks
        if masks is not None:
            masks = masks if isinstance(masks, torch.Tensor) else torch.stack(list(masks))  # [b, N, N]
            if bs > b:  # padding requests: a full mask (their rows are dropped)
                masks = torch.cat([masks, masks.new_ones(bs - b, st.tokens, st.tokens)])
        static = self._static_batch(fb, fb.mode, bs, fb.prefix_lens + [0] * (bs - b), masks)
        static.device_prefix = pad_device_prefix(fb.device_prefix, bs)
        self.backend.init_metadata_for_replay(static)
        self.graphs[(fb.mode, bs)].replay()
        t = b * st.tokens
        return st.logits[:t], (st.features[:t] if st.features is not None else None)

    def _fill(self, fb: ForwardBatch, st: _Static, b: int, bs: int) -> None:
        t, tp = b * st.tokens, bs * st.tokens
        st.input_ids[:t].copy_(fb.input_ids)
        st.positions[:t].copy_(fb.positions)
        st.out_slots[:t].copy_(fb.out_slots)
        st.req_rows[:b].copy_(fb.req_rows)
        if bs > b:  # padding: token 0 at position 0 into slot 0, reading the first real row
            st.input_ids[t:tp].zero_()
            st.positions[t:tp].zero_()
            st.out_slots[t:tp].zero_()
            st.req_rows[b:bs].copy_(fb.req_rows[:1].expand(bs - b))

    def _static_batch(self, template: ForwardBatch, mode: ForwardMode, bs: int, prefix_lens: list[int],
                      masks: torch.Tensor | None) -> ForwardBatch:
        st = self.static[mode]
        t = bs * st.tokens
        return ForwardBatch(
            mode=mode, input_ids=st.input_ids[:t], positions=st.positions[:t], out_slots=st.out_slots[:t],
            req_rows=st.req_rows[:bs], prefix_lens=prefix_lens, extend_lens=[st.tokens] * bs,
            req_to_token=template.req_to_token, kv_pool=template.kv_pool, attn_backend=self.backend,
            custom_masks=masks, logit_rows=None)

    def _run(self, fb: ForwardBatch, st: _Static, bs: int) -> None:
        t = bs * st.tokens
        hidden, aux = self.model(fb)
        st.logits[:t].copy_(self.model.compute_logits(hidden, float32=False))  # copy_ converts
        if st.features is not None:
            st.features[:t].copy_(hidden if self.feature_mode == "final" else torch.cat(aux, dim=-1))
