"""Prefill CUDA graphs: EXTEND forwards captured at bucketed token counts.

An eager prefill of a small model is bound by the host, not the GPU: SmolLM2-135M's
30 layers are ~300 kernel launches, each with tens of microseconds of Python and launch
overhead, many times the GPU time of a short prompt and most of a short request's time
to first token. A batch of prompts is host-bound the same way. Graphs of a prefill chunk
at 16..4096 new tokens (any cached prefixes) turn that into one launch.

Each token bucket B has two graphs: one request, and up to `max_reqs` requests (a batch
of r <= max_reqs replays the latter, the rest of its request rows padding). A chunk of n
new tokens replays the smallest B >= n. Rows [n, B) are padding: stale token ids and
positions, their K/V written to the scratch slot 0. The attention kernels read each
request's true prefix and extend lengths from device metadata
(`TritonBackend.init_prefill_graph_state`) and a padding request has extend length 0, so
padding rows are never computed as queries nor seen as keys; every other op is row-wise,
so real rows never mix with padding. Logits are computed for the graph's request count of
rows (`fb.logit_rows`, padded with row 0: the sampled requests' last rows, or none for a
middle chunk), features for every row (EAGLE drafts read them). Custom masks, draft tails
and more logit rows than the graph's requests (prompt logprobs) run eagerly.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specserve.core.forward_batch import ForwardBatch, ForwardMode
from specserve.models.layers import activation_dtype
from specserve.runner.cuda_graph import capture_each

if TYPE_CHECKING:
    from specserve.attention.base import AttentionBackend
    from specserve.models.llama import LlamaForCausalLM

# at most a third of a graph is padding past 64 tokens
BUCKETS = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
# The most requests one graph carries: the extend kernel's grid and the logits scale with
# it (64 rows of a 128k vocabulary: 33 MB a replay); a larger batch prefills eagerly.
MAX_REQS = 64


def prefill_sizes(max_tokens: int) -> list[int]:
    """The captured token counts: BUCKETS up to max_tokens (none when it is below 16)."""
    return [b for b in BUCKETS if b <= max_tokens]


@dataclass
class _Static:
    """Inputs and outputs of every prefill graph, sized for the largest."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    out_slots: torch.Tensor  # [B] int64; padding rows: the scratch slot 0
    req_rows: torch.Tensor  # [R] int64; padding requests: row 0 (they read nothing)
    logit_rows: torch.Tensor  # [R] int64: the rows whose logits are computed (padding: row 0)
    logits: torch.Tensor  # [R, V] float32
    features: torch.Tensor | None  # [B, F]


class PrefillGraphs:
    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, vocab_size: int, max_tokens: int,
                 template: ForwardBatch, feature_mode: str | None = None, capture: bool = True,
                 max_reqs: int = MAX_REQS) -> None:
        """`template` supplies the table and KV pool; `feature_mode` as ModelRunner.capture_features
        set it (None: logits only); `max_reqs`: the most requests a graph carries.
        capture=False runs the same body eagerly per prefill (tests on a CPU, with the
        Triton backend interpreted)."""
        self.model, self.backend, self.feature_mode = model, backend, feature_mode
        self.template, self.sizes = template, prefill_sizes(max_tokens)
        self.req_sizes = sorted({1, max(1, min(max_reqs, MAX_REQS))})
        n, r, dev = (self.sizes[-1] if self.sizes else 0), self.req_sizes[-1], template.input_ids.device
        zeros = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        width = model.config.hidden_size * (len(model.aux_layers) if feature_mode == "aux" else 1)
        logits = zeros(r, vocab_size, dtype=torch.float32)
        self.static = _Static(zeros(n), zeros(n), zeros(n), zeros(r), zeros(r), logits,
                              zeros(n, width, dtype=activation_dtype(model)) if feature_mode else None)
        backend.init_prefill_graph_state(r)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (tokens, requests) -> graph
        self._captured: ForwardBatch | None = None  # the static batch of the graph being captured
        # every pair: a graph's padding requests take no rows, so 3 requests of 20 tokens replay (32, R)
        self.keys = [(b, q) for b in self.sizes for q in self.req_sizes]
        if capture and self.keys:
            self.graphs, _ = capture_each(self.keys, self._prepared_body, dev,
                                          prepare=self._prepare, desc="Capturing prefill CUDA graphs")

    def _prepare(self, key: tuple[int, int]) -> None:
        """Before capturing graph (b tokens, r requests): its static batch over table row 0,
        no prefix, every row the first request's (every K/V into slot 0)."""
        b, r = key
        self._captured = self._batch(b, r, [0] * r, [b] + [0] * (r - 1))
        self.backend.init_metadata_for_capture(self._captured)

    def _prepared_body(self, key: tuple[int, int]) -> None:
        """The body of graph `key` over the static batch `_prepare` built for it."""
        assert self._captured is not None, "capture_each runs _prepare(key) first"
        self._body(self._captured)

    def can_run(self, fb: ForwardBatch) -> bool:
        return (fb.mode == ForwardMode.EXTEND and bool(self.sizes) and fb.batch_size <= self.req_sizes[-1]
                and fb.custom_masks is None and fb.draft_tail is None and fb.device_prefix is None
                and fb.input_ids.numel() <= self.sizes[-1] and fb.logit_rows is not None
                and fb.logit_rows.numel() <= self._reqs(fb.batch_size))

    def _reqs(self, batch_size: int) -> int:
        """The request count of the graph a batch of `batch_size` requests replays."""
        return self.req_sizes[bisect.bisect_left(self.req_sizes, batch_size)]

    def replay(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [len(fb.logit_rows), V], features [n, F] or None) of the batch's n new
        tokens, views of static buffers that the next replay rewrites."""
        static_fb = self._fill(fb)
        key = (static_fb.input_ids.numel(), static_fb.batch_size)
        assert key in self.keys, key  # eager bodies (capture=False) replay only what a capture would hold
        if self.graphs:
            self.graphs[key].replay()
        else:
            self._body(static_fb)
        st, n, rows = self.static, fb.input_ids.numel(), fb.logit_rows
        assert rows is not None  # can_run admits only batches with logit rows
        return st.logits[:rows.numel()], (st.features[:n] if st.features is not None else None)

    def _fill(self, fb: ForwardBatch) -> ForwardBatch:
        """Copy fb into the static inputs of the smallest graph that holds it, write the
        attention metadata, and return that graph's static batch."""
        rows = fb.logit_rows
        assert rows is not None  # can_run admits only batches with logit rows
        st, n, k = self.static, fb.input_ids.numel(), rows.numel()
        b, r, real = self.sizes[bisect.bisect_left(self.sizes, n)], self._reqs(fb.batch_size), fb.batch_size
        st.input_ids[:n].copy_(fb.input_ids)
        st.positions[:n].copy_(fb.positions)
        st.out_slots[:n].copy_(fb.out_slots)
        # Padding rows keep whatever ids and positions the buffers last held (valid values,
        # and their outputs are dropped); only their K/V must go to the scratch slot 0.
        st.out_slots[n:b].zero_()
        st.req_rows[:real].copy_(fb.req_rows)
        st.req_rows[real:r].zero_()
        st.logit_rows[:k].copy_(rows)
        st.logit_rows[k:r].zero_()  # a stale row of a larger graph would index past b
        pad = r - real
        static_fb = self._batch(b, r, fb.prefix_lens + [0] * pad, fb.extend_lens + [0] * pad)
        self.backend.init_metadata_for_replay(static_fb)
        return static_fb

    def _batch(self, b: int, r: int, prefix_lens: list[int], extend_lens: list[int]) -> ForwardBatch:
        """The static batch of graph (b tokens, r requests) with these per-request lengths
        (padding requests: 0 and 0)."""
        st, tp = self.static, self.template
        return ForwardBatch(ForwardMode.EXTEND, st.input_ids[:b], st.positions[:b], st.out_slots[:b],
                            st.req_rows[:r], prefix_lens, extend_lens, tp.req_to_token, tp.kv_pool, self.backend,
                            logit_rows=None)

    def _body(self, fb: ForwardBatch) -> None:
        """The forward over fb's static rows (its metadata written)."""
        st, b, r = self.static, fb.input_ids.numel(), fb.batch_size
        hidden, aux = self.model(fb)
        st.logits[:r].copy_(self.model.compute_logits(hidden.index_select(0, st.logit_rows[:r]), float32=False))
        if st.features is not None:
            st.features[:b].copy_(hidden if self.feature_mode == "final" else torch.cat(aux, dim=-1))
