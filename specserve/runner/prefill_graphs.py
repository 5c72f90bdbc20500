"""Prefill CUDA graphs: one request's EXTEND forward, captured at bucketed token counts.

An eager prefill of a small model is bound by the host, not the GPU: SmolLM2-135M's
30 layers are ~300 kernel launches at ~30-60 us of Python and launch overhead each,
about 20 ms for a prompt the H100 computes in ~1 ms, and most of a short request's time
to first token. Graphs of one request's forward at 16..512 new tokens (any cached prefix)
turn that into one launch.

A chunk of n new tokens replays the smallest graph of B >= n rows. Rows [n, B) are
padding: stale token ids and positions, their K/V written to the scratch slot 0. The attention
kernels read the true n from device metadata (`TritonBackend.init_prefill_graph_state`),
so padding rows are never computed as queries nor seen as keys; every other op is
row-wise, so real rows never mix with padding. Logits are computed for at most one row
(the prompt's last; a middle chunk samples nothing), features for every row (EAGLE
drafts read them). Batches of several requests, custom masks and prompt logprobs (logits
of every row) run eagerly.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specserve.runner.cuda_graph import capture_each
from specserve.runner.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from specserve.attention.base import AttentionBackend
    from specserve.models.llama import LlamaForCausalLM

BUCKETS = (16, 32, 64, 96, 128, 192, 256, 384, 512)  # at most a third of a graph is padding past 64


def prefill_sizes(max_tokens: int) -> list[int]:
    """The captured token counts: BUCKETS up to max_tokens (none when it is below 16)."""
    return [b for b in BUCKETS if b <= max_tokens]


@dataclass
class _Static:
    """Inputs and outputs of every prefill graph, sized for the largest."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    out_slots: torch.Tensor  # [B] int64; padding rows: the scratch slot 0
    req_row: torch.Tensor  # [1] int64
    logit_row: torch.Tensor  # [1] int64: the row whose logits are computed
    logits: torch.Tensor  # [1, V] float32
    features: torch.Tensor | None  # [B, F]


class PrefillGraphs:
    def __init__(self, model: "LlamaForCausalLM", backend: "AttentionBackend", vocab_size: int, max_tokens: int,
                 template: ForwardBatch, feature_mode: str | None = None, capture: bool = True) -> None:
        """`template` supplies the table and KV pool; `feature_mode` as ModelRunner.capture_features
        set it (None: logits only). capture=False runs the same body eagerly per prefill
        (tests on a CPU, with the Triton backend interpreted)."""
        self.model, self.backend, self.feature_mode = model, backend, feature_mode
        self.template, self.sizes = template, prefill_sizes(max_tokens)
        n, dev = (self.sizes[-1] if self.sizes else 0), template.input_ids.device
        zeros = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        width = model.config.hidden_size * (len(model.aux_layers) if feature_mode == "aux" else 1)
        logits = zeros(1, vocab_size, dtype=torch.float32)
        self.static = _Static(zeros(n), zeros(n), zeros(n), zeros(1), zeros(1), logits,
                              zeros(n, width, dtype=next(model.parameters()).dtype) if feature_mode else None)
        backend.init_prefill_graph_state()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._captured: ForwardBatch | None = None  # the static batch of the size being captured
        if capture and self.sizes:
            self.graphs, _ = capture_each(self.sizes, lambda b: self._body(self._captured), dev, prepare=self._prepare,
                                          desc="Capturing prefill CUDA graphs")

    def _prepare(self, b: int) -> None:
        """Before capturing size b: its static batch over table row 0, no prefix, b real rows
        (every K/V into slot 0)."""
        self._captured = self._batch(b, 0, b)
        self.backend.init_metadata_for_capture(self._captured)

    def can_run(self, fb: ForwardBatch) -> bool:
        return (fb.mode == ForwardMode.EXTEND and fb.batch_size == 1 and bool(self.sizes)
                and fb.custom_masks is None and fb.draft_tail is None and fb.device_prefix is None
                and fb.extend_lens[0] <= self.sizes[-1] and fb.logit_rows is not None and fb.logit_rows.numel() <= 1)

    def replay(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [len(fb.logit_rows), V], features [n, F] or None) of the request's n new
        tokens, views of static buffers that the next replay rewrites."""
        static_fb = self._fill(fb)
        b = static_fb.input_ids.numel()
        if self.graphs:
            self.graphs[b].replay()
        else:
            self._body(static_fb)
        st, n = self.static, fb.extend_lens[0]
        return st.logits[:fb.logit_rows.numel()], (st.features[:n] if st.features is not None else None)

    def _fill(self, fb: ForwardBatch) -> ForwardBatch:
        """Copy fb into the static inputs of the smallest graph that holds it, write the
        attention metadata, and return that graph's static batch."""
        st, n = self.static, fb.extend_lens[0]
        b = self.sizes[bisect.bisect_left(self.sizes, n)]
        st.input_ids[:n].copy_(fb.input_ids)
        st.positions[:n].copy_(fb.positions)
        st.out_slots[:n].copy_(fb.out_slots)
        # Padding rows keep whatever ids and positions the buffers last held (valid values,
        # and their outputs are dropped); only their K/V must go to the scratch slot 0.
        st.out_slots[n:b].zero_()
        st.req_row.copy_(fb.req_rows)
        if fb.logit_rows.numel():
            st.logit_row.copy_(fb.logit_rows)
        static_fb = self._batch(b, fb.prefix_lens[0], n)
        self.backend.init_metadata_for_replay(static_fb)
        return static_fb

    def _batch(self, b: int, prefix: int, n: int) -> ForwardBatch:
        """The static batch of graph size b: one request, `prefix` cached tokens, n real rows."""
        st, tp = self.static, self.template
        return ForwardBatch(ForwardMode.EXTEND, st.input_ids[:b], st.positions[:b], st.out_slots[:b], st.req_row,
                            [prefix], [n], tp.req_to_token, tp.kv_pool, self.backend, logit_rows=None)

    def _body(self, fb: ForwardBatch) -> None:
        """The forward over fb's static rows (its metadata written)."""
        st, b = self.static, fb.input_ids.numel()
        hidden, aux = self.model(fb)
        st.logits.copy_(self.model.compute_logits(hidden.index_select(0, st.logit_row)))
        if st.features is not None:
            st.features[:b].copy_(hidden if self.feature_mode == "final" else torch.cat(aux, dim=-1))
