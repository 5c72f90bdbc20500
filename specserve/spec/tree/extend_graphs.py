"""CUDA graphs for EAGLE's draft extend after verify, and the root state it leaves.

After each verify the draft runs over the positions the step committed (1 to
num_steps + 1 per request), pairing each with the target's feature there (eagle.py), and
its output at the last one is the next step's root state: the root's top-k children and
the hidden their depth-1 forwards take. Eagerly that is one small forward with its
metadata, gathers and top-k: dozens of launches and their Python, every step.

Captured per batch size with exactly L = num_steps + 1 tokens per request: request b's
committed tokens first, then padding tokens (token 0, K/V into the scratch slot 0). The
extend is causal and padding comes last, so no committed token attends to padding;
padding rows' outputs are never read. The features are gathered inside the graph from the
verify's per-node features; the root rows are picked by a static index. Padding requests
read through the first real request's table row and write only the scratch slot.

With L = 1 (the draft's catch-up after a plain decode step: one committed token per
request) the extend is a decode at position kv_len - 1 and runs on the decode kernel's
graph state, which the L > 1 graphs do not use, so both can live on one backend.

The graph also writes the root states into `RootStates` (padding requests into its
scratch row), and every per-replay index lives in one flat static buffer, so a replay
from host lists is one host->device copy, one feature gather, the metadata copy and the
graph: a handful of launches instead of a few dozen.

A draft LLM (STANDALONE: `feature_width` 0) takes no features and keeps no hidden; its
catch-up over the tokens a verify committed is the same padded extend. With
`table_slots` the static slots hold flat table indices (row * stride + position; -1 for
padding, the scratch slot 0), resolved inside the graph: the host, which does not know
the slots a verify kept, then reads nothing back.
"""
from __future__ import annotations

import bisect

import torch

from specserve.cache.req_table import slots_at
from specserve.core.forward_batch import ForwardBatch, ForwardMode
from specserve.core.h2d import h2d_many
from specserve.models.layers import activation_dtype
from specserve.runner.cuda_graph import capture_each, capture_sizes, pad_device_prefix
from specserve.spec.tree.draft import top_children
from specserve.spec.tree.root_states import RootState, RootStates
from specserve.spec.tree.rows import root_rows


class DraftExtendGraphs:
    def __init__(self, model, backend, kv_pool, req_to_token: torch.Tensor, max_bs: int, tokens_per_req: int,
                 feature_width: int, topk: int, token_map: torch.Tensor | None, roots: RootStates,
                 capture: bool = True, table_slots: bool = False) -> None:
        """`capture` False runs the same padded batches eagerly (any backend, CPU tests);
        `feature_width` 0: a draft LLM (no features); `table_slots`: see the module docstring."""
        self.model, self.backend, self.kv_pool, self.table = model, backend, kv_pool, req_to_token
        self.L, self.topk, self.token_map, self.roots = tokens_per_req, topk, token_map, roots
        self.sizes = capture_sizes(max_bs)
        n, dev = self.sizes[-1], req_to_token.device
        dtype = activation_dtype(model)
        self.capture, self.table_slots = capture, table_slots
        self.mode = ForwardMode.DECODE if self.L == 1 else ForwardMode.DRAFT_EXTEND
        if capture:
            backend.init_cuda_graph_state(n, self.L, causal=True)
        # ids, positions, slots, feature rows [n*L] each; table rows, last, root-state rows [n] each
        self._parts = [n * self.L] * 4 + [n] * 3
        self.index = torch.zeros(sum(self._parts), dtype=torch.int64, device=dev)
        self.ids, self.pos, self.slots, self.feat_rows, self.rows, self.last, self.dst = self.index.split(self._parts)
        self.features = torch.zeros(n * self.L, feature_width, dtype=dtype, device=dev) if feature_width else None
        # table_slots: the slots resolved from the indices (kept apart, so a replay never rewrites its own input)
        self.resolved = torch.zeros(n * self.L, dtype=torch.int64, device=dev) if table_slots else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._plans: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # B -> `_scatter_plan`
        if capture:
            batches = {bs: self._batch(bs, [0] * bs) for bs in self.sizes}
            self.graphs, _ = capture_each(
                self.sizes, lambda bs: self._run(batches[bs], bs), dev,
                prepare=lambda bs: backend.init_metadata_for_capture(batches[bs]))

    def can_run(self, bsz: int) -> bool:
        return bsz <= self.sizes[-1]

    def size_for(self, bsz: int) -> int:
        """The captured batch size a batch of `bsz` is padded to."""
        return self.sizes[bisect.bisect_left(self.sizes, bsz)]

    @torch.inference_mode()
    def replay_host(self, tokens: list[list[int]], reqs: list[list[int]], features: torch.Tensor | None,
                    prefix_lens: list[int]) -> None:
        """Extend B requests and write their root states (rows reqs[0]) from host lists.

        `tokens` = [ids, positions, slots, feature rows] (each [B*L]), `reqs` = [table rows,
        last] (each [B]); `features` [*, F] the verify's per-node features; `prefix_lens`
        the positions each request's extend starts at."""
        b = len(reqs[0])
        bs = self.size_for(b)
        host = torch.zeros(self.index.numel(), dtype=torch.int64)
        pad = bs - b
        parts = [*tokens, reqs[0] + reqs[0][:1] * pad, reqs[1] + [i * self.L for i in range(b, bs)],
                 reqs[0] + [self.roots.scratch_row] * pad]
        offset = 0
        for values, size in zip(parts, self._parts):  # padding tokens: id 0, position 0, slot 0, feature row 0
            host[offset:offset + len(values)] = torch.tensor(values, dtype=torch.int64)
            offset += size
        if self.table_slots:  # the padding requests' tokens: table index -1, the scratch slot 0
            slots = host[2 * self._parts[0]:3 * self._parts[0]]
            slots[b * self.L:] = -1
        self.index.copy_(host, non_blocking=True)  # pageable: staged before the call returns
        self._go(bs, b, features, prefix_lens)

    @torch.inference_mode()
    def replay(self, index: list[torch.Tensor], features: torch.Tensor | None,
               prefix_lens: list[int] | torch.Tensor) -> None:
        """The same from device tensors: `index` = [ids, positions, slots (with
        `table_slots`, flat table indices: -1 for padding), feature rows] (each [B*L]),
        [rows, last] (each [B]); root states go to `rows`. The inputs and
        the padding go into the flat static buffer in one scatter (one launch where a copy
        per buffer took a dozen: after every plain step at batch 64 that host work is
        not hidden)."""
        ids, pos, slots, feat_rows, rows, last = index
        b = rows.shape[0]
        bs = self.size_for(b)
        dest, pad = self._scatter_plan(b, bs)
        # in dest's order: the real values of ids, pos, slots, feature rows, rows, last and
        # dst (= rows), the constant padding, then the padding requests' rows (the first real one)
        values = torch.cat([ids, pos, slots, feat_rows, rows, last, rows, pad, rows[:1].expand(bs - b)])
        self.index.index_copy_(0, dest, values)
        self._go(bs, b, features, prefix_lens)

    def _scatter_plan(self, b: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat positions, constant padding values) of a replay over B requests padded to
        bs; see `replay`. Padding tokens: id 0, position 0, slot 0, feature row 0; padding
        requests: their own first token as "last", root states into the scratch row. With
        `table_slots` the padding tokens' table index is -1 (the scratch slot 0)."""
        plan = self._plans.get(b)
        if plan is None:
            L, dev = self.L, self.index.device
            starts = [sum(self._parts[:k]) for k in range(len(self._parts))]
            span = lambda k, lo, hi: torch.arange(starts[k] + lo, starts[k] + hi)  # noqa: E731
            real = [span(k, 0, b * L) for k in range(4)] + [span(k, 0, b) for k in range(4, 7)]
            padding = [span(k, b * L, bs * L) for k in range(4)] + [span(5, b, bs), span(6, b, bs)]
            tokens = torch.zeros(4, (bs - b) * L, dtype=torch.int64)
            tokens[2] = -1 if self.table_slots else 0
            values = [tokens.view(-1), torch.arange(b, bs) * L,
                      torch.full((bs - b,), self.roots.scratch_row, dtype=torch.int64)]
            # non_blocking: a plan first built inside a pipelined step must not wait for the GPU
            dest, pad = h2d_many([torch.cat(real + padding + [span(4, b, bs)]), torch.cat(values)], dev)
            plan = self._plans[b] = (dest, pad)
        return plan

    def static_index(self) -> list[torch.Tensor]:
        """The static per-replay inputs a caller may fill itself on the device (then
        `replay_filled`): [ids, positions, slots, feature rows] ([max_bs * L] each), then
        [table rows, last rows, root-state rows] ([max_bs] each), padding included."""
        return [self.ids, self.pos, self.slots, self.feat_rows, self.rows, self.last, self.dst]

    def prefix_buffer(self, padded_bs: int) -> torch.Tensor | None:
        """The int32 prefix lengths [>= padded_bs] that the captured extend's attention
        reads, for a caller that writes them itself (kernels/ahead.py) and then passes them
        as the prefix lengths: None when not captured or the backend has none."""
        get = getattr(self.backend, "verify_prefix_buffer", None) if self.capture else None
        buf = get(self.L) if get is not None else None
        return buf if buf is not None and buf.numel() >= padded_bs else None

    @torch.inference_mode()
    def replay_filled(self, b: int, features: torch.Tensor, prefix_lens: list[int] | torch.Tensor) -> None:
        """Replay for B requests whose static inputs, padding requests included, the caller
        wrote (eagle.py's draft-ahead kernel)."""
        self._go(self.size_for(b), b, features, prefix_lens)

    @torch.inference_mode()
    def run_inline(self, b: int, features: torch.Tensor, prefix_lens: torch.Tensor) -> RootState:
        """replay_filled for exactly B requests (no padding) without a replay of its own,
        so a caller's CUDA graph can hold it (spec/eagle/step_graphs.py): the metadata goes into
        the backend's graph buffers from the device prefix lengths [B]. Returns the root
        states it wrote (logp [B, topk], ids [B, topk], hidden [B, H] or None), which a
        tree pass in the same capture reads from here rather than gathering them back."""
        state = self._go(b, b, features, prefix_lens, replay=False)
        assert state is not None, "an unreplayed run returns its root states"
        return state

    def _go(self, bs: int, b: int, features: torch.Tensor | None, prefix_lens: list[int] | torch.Tensor,
            replay: bool = True) -> RootState | None:
        """`prefix_lens` [b]: host ints, or a device tensor when the host does not know them
        yet (a pipelined step, spec/pipeline.py). `replay` False runs the captured body
        itself (inside a caller's capture)."""
        t = bs * self.L
        if self.features is not None:
            assert features is not None, "a head's extend reads the target's features"
            torch.index_select(features, 0, self.feat_rows[:t], out=self.features[:t])
        if isinstance(prefix_lens, torch.Tensor):
            fb = self._batch(bs, [0] * bs)
            fb.device_prefix = pad_device_prefix(prefix_lens, bs)
        else:
            fb = self._batch(bs, prefix_lens + [0] * (bs - b))
        if not self.capture:
            self.backend.init_forward_metadata(fb)
            return self._run(fb, bs)
        self.backend.init_metadata_for_replay(fb)
        if replay:
            self.graphs[bs].replay()
            return None
        return self._run(fb, bs)

    def _batch(self, bs: int, prefix_lens: list[int]) -> ForwardBatch:
        t = bs * self.L
        slots = self.resolved if self.resolved is not None else self.slots
        return ForwardBatch(self.mode, self.ids[:t], self.pos[:t], slots[:t], self.rows[:bs],
                            prefix_lens, [self.L] * bs, self.table, self.kv_pool, self.backend)

    def _run(self, fb: ForwardBatch, bs: int) -> RootState:
        t = bs * self.L
        if self.resolved is not None:  # flat table indices -> slots, before the forward writes K/V there
            self.resolved[:t].copy_(slots_at(self.table, self.slots[:t]))
        if self.features is None:  # a draft LLM
            h_logits, h_next = self.model(fb)[0], None
        else:
            h_logits, h_next = self.model(fb, self.features[:t])
        dst = self.dst[:bs]
        # the last rows' normed and raw states; the raw one also lands in roots.hidden[dst]
        x_last, hidden = root_rows(h_logits, h_next, self.last[:bs], dst, self.roots.hidden)
        # the root states' children, also into their table rows (as RootStates.write would)
        logp, ids = top_children(self.model.compute_logits(x_last), self.topk, self.token_map,
                                 into=(dst, self.roots.logp, self.roots.ids))
        return logp, ids, hidden
