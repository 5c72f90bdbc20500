"""EAGLE-2, EAGLE-3 and MTP drafting: a draft head fed the target's own features.

Pairing (EAGLE's training layout, internals note 1.2): draft position p consumes the
target's feature at p (its final normed hidden, or EAGLE-3's auxiliary states) together
with token p+1, and predicts token p+2. The draft's KV for position p therefore needs
the token *after* p, which is why the root (last committed token, position kv_len) pairs
with the feature at kv_len - 1.

Draft KV invariant: between speculative steps, every position < kv_len of a running
request holds draft KV computed from the target's true features, in the same slot as its
target KV (one slot index addresses both pools). It is kept eagerly:
  * `on_extend`: after each target prefill chunk [s, e), a DRAFT_EXTEND over the same
    slots pairs feature p with token p+1 (the next prompt token, or for the final chunk
    the token just sampled; SGLang PR 26329 is the chunked-prefill bug this avoids);
  * `on_verified`: after verify, a DRAFT_EXTEND over the committed positions pairs each
    accepted node's feature with the token committed after it;
and lazily for plain steps (the governor's): `on_decoded` keeps the step's features and
tokens on the device (backlog.py), and `propose` first extends the draft over them.
Because a finished request's slots go to the prefix cache with their draft KV, a later
request that borrows them finds valid draft KV; only the last borrowed position could
have been paired with a different next token, so the KV manager recomputes it
(`prefix_backoff`).

Each extend's last position gives the root state: the draft's top-k children of the
root and the hidden that their depth-1 forwards take. `propose` expands trees from it
with `TreeDrafter` (shift 1: depth-d nodes at position kv_len + d - 1). Drafting is
deterministic top-k, so verification stays lossless for sampling.

Drafting ahead (CUDA graphs, greedy walks): `draft_ahead` runs between a verify's
acceptance and its read-back, from the accepted paths on the device. It writes the
committed positions' slots into the table rows, queues the draft extend and the next
step's trees, and returns; the host then reads the step back and does its bookkeeping
while the GPU drafts. The next `propose` over the same requests takes those trees.
"""
from __future__ import annotations

import logging

import torch

from specserve import kernels
from specserve.cache.kv_pool import KVPool
from specserve.core.batch import ScheduleBatch
from specserve.core.config import SpecConfig
from specserve.core.forward_batch import ForwardMode
from specserve.core.h2d import h2d
from specserve.core.request import Req
from specserve.engine.kv_manager import KVManager
from specserve.engine.speculation import Decoded
from specserve.models.draft_loader import load_draft
from specserve.models.quantization import draft_flag
from specserve.models.token_map import load_token_map
from specserve.runner.model_runner import ModelRunner, make_backend
from specserve.runner.prefill_graphs import prefill_sizes
from specserve.spec.accept import DevicePaths, GreedyWalk
from specserve.spec.drafts import Drafts
from specserve.spec.eagle import LAYOUTS, batch_tree, step_graphs
from specserve.spec.eagle.backlog import RING, DraftBacklog
from specserve.spec.eagle.prefill_graphs import DraftPrefillGraphs
from specserve.spec.proposer import DraftsAhead, Proposer, Verified, WholeStep
from specserve.spec.tree.ahead import TreesAhead
from specserve.spec.tree.draft import TreeDrafter, Trees, TreeStep, frontier_batch, top_children
from specserve.spec.tree.extend_graphs import DraftExtendGraphs
from specserve.spec.tree.graphs import TreeDraftGraphs
from specserve.spec.tree.root_states import RootState, RootStates

logger = logging.getLogger("specserve")


_FEATURES = "EAGLE has the runner capture the target's features (capture_features)"


def extend_tokens(all_ids: list[int], start: int, end: int) -> list[int]:
    """The tokens paired with features [start, end): each position's *next* token."""
    return all_ids[start + 1:end + 1]


class EagleProposer(Proposer, DraftsAhead):
    def __init__(self, spec: SpecConfig, runner: ModelRunner, kv: KVManager, max_running: int) -> None:
        draft, (steps, topk, nodes) = spec.draft_path, spec.tree
        logger.info("Drafting with %s", "the target's own MTP layers" if draft == runner.model_dir else draft)
        quantization = draft_flag(spec.draft_model_quantization, runner.model.weight_quant)
        self.model = load_draft(draft, runner.model, LAYOUTS[spec.name], runner.dtype, runner.device,
                                _token_map(spec, runner), quantization)
        runner.capture_features(self.model.feature_mode, self.model.aux_layers)
        c = self.model.config
        self.pool = KVPool(runner.num_slots, c.num_layers, c.kv_heads_per_rank, c.head_dim, runner.kv_dtype,
                           runner.device)
        self.backend = make_backend(spec.draft_attention_backend or runner.attn_backend_name, runner.device)
        self.runner, self.kv = runner, kv
        self.topk, self.max_nodes = topk, nodes
        self.scratch_per_req = topk * (steps - 1)
        token_map = self.model.token_map
        self.token_map = token_map.to(runner.device) if token_map is not None else None
        self.tree = TreeDrafter(kv, self._tree_step, topk, steps, shift=1, token_map=self.token_map)
        # the batch tree (batch_tree.py): drafted by the step graphs of batch_from requests and more
        (self.batch_tree, self.batch_nodes), self.batch_from = self._batch_tree(spec), spec.batch_tree_from
        self.roots = RootStates(kv.table.table.shape[0], topk, c.hidden_size, runner.dtype, runner.device)
        self.extend_len = steps + 1  # the most tokens one verify commits
        self.extend_graphs: DraftExtendGraphs | None = None  # after a verify
        self.catchup_graphs: DraftExtendGraphs | None = None  # after the governor's plain steps (backlog.py)
        self.backlog = DraftBacklog(kv.table.table.shape[0], self._feature_width(runner), runner.dtype, runner.device)
        self.prefill_graphs: DraftPrefillGraphs | None = None  # after one request's prefill chunk
        self.trees_ahead = TreesAhead()  # the next propose's trees, drafted ahead
        if self._can_capture(runner):
            self.tree.graphs = self._capture_tree(runner, max_running) if steps > 1 else None
            if self.batch_tree is not None:
                self.batch_tree.graphs = self._capture_tree(runner, max_running, self.batch_tree, self.batch_nodes)
            self.extend_graphs = self._capture_extend(runner, max_running, self.extend_len)
            # a backend of its own, apart from the draft extend's graph state
            self.catchup_graphs = self._capture_extend(runner, max_running, RING, make_backend(
                spec.draft_attention_backend or runner.attn_backend_name, runner.device))
            self.prefill_graphs = self._capture_prefill(runner, max_running)

    # -- request life cycle -------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        assert req.rid in self.roots.ready, "on_extend runs for a request's final prefill chunk first"

    def remove_request(self, req: Req) -> None:
        self.roots.ready.discard(req.rid)
        self.backlog.forget(req)
        if not req.finished:  # retracted: it comes back under its id, and its tree drafted ahead is stale
            self.trees_ahead.clear()  # (a finished request's id never returns; the others' trees stay: keep_ahead)

    # -- keeping the draft KV in sync -----------------------------------------------------
    def on_extend(self, batch: ScheduleBatch, features: torch.Tensor | None) -> None:
        """Draft-extend the chunk the target just prefilled, over the same slots."""
        assert features is not None, _FEATURES
        graphs = self.prefill_graphs
        if graphs is not None and graphs.can_run(sum(batch.extend_lens), len(batch.reqs)):
            chunks = [(extend_tokens(req.all_ids, start, start + n), start, req.row, req.row if sampled else None)
                      for req, start, n, sampled in zip(batch.reqs, batch.prefix_lens, batch.extend_lens,
                                                        batch.sample_mask)]
            graphs.run(chunks, batch.out_slots, features)
            self.roots.mark(batch.sampled_reqs)
            return
        ids: list[int] = []
        for req, start, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            ids += extend_tokens(req.all_ids, start, start + n)
        draft = ScheduleBatch(ForwardMode.DRAFT_EXTEND, batch.reqs, ids, batch.out_slots,
                              batch.prefix_lens, batch.extend_lens, batch.sample_mask)
        self._set_roots(batch.sampled_reqs, *self._step(draft, features))

    def on_verified(self, reqs: list[Req], verified: Verified) -> None:
        """Draft-extend each request's committed positions with the target's features there."""
        if verified.extended:  # draft_ahead queued it before the read-back
            return
        assert verified.features is not None and verified.kv_slots is not None, _FEATURES
        if self.extend_graphs is not None and self.extend_graphs.can_run(len(reqs)):
            return self._extend_graphed(reqs, verified, self.extend_graphs)
        ids: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        nodes: list[int] = []
        n = verified.features.shape[1]
        for b, (req, tokens) in enumerate(zip(reqs, verified.committed)):
            start = req.kv_len - len(tokens)  # commit already advanced kv_len
            ids += extend_tokens(req.all_ids, start, req.kv_len)  # == the committed tokens
            starts.append(start)
            lens.append(len(tokens))
            nodes += [b * n + i for i in verified.paths[b][:len(tokens)]]
        feats = verified.features.reshape(-1, verified.features.shape[-1])
        feats = feats[h2d(nodes, feats.device)]  # [sum(lens), F]: the accepted nodes' features
        slots = torch.tensor([x for s in verified.kv_slots for x in s], dtype=torch.int64)
        draft = ScheduleBatch(ForwardMode.DRAFT_EXTEND, reqs, ids, slots, starts, lens,
                              [True] * len(reqs))
        self._set_roots(reqs, *self._step(draft, feats))

    def on_decoded(self, reqs: list[Req], step: Decoded) -> None:
        """A plain decode step fed each request's root: its feature and the token just
        sampled go to the backlog (device writes queued behind the forward), and the draft
        extends over them when speculation resumes (`propose`), or now when a backlog
        fills its ring."""
        self.trees_ahead.clear()  # trees drafted ahead are from before this token
        if self.backlog.push(reqs, step):
            self._catch_up(reqs)

    def cacheable(self, req: Req) -> int | None:
        return self.backlog.cacheable(req)

    def _catch_up(self, reqs: list[Req]) -> None:
        """Extend the draft over the backlogs of `reqs`, each padded to RING tokens through
        the catch-up graphs, else as one eager DRAFT_EXTEND; their root states come from
        their last positions."""
        g = self.catchup_graphs
        graphed = g is not None and g.can_run(len(reqs))
        work = self.backlog.take(reqs, self.kv.table.table, g.L if g is not None and graphed else None)
        if work is None:
            return
        if g is not None and graphed:
            g.replay([work.ids, work.positions, work.slots, work.cells, work.rows, work.last], self.backlog.features,
                     work.prefix_lens)
            self.roots.mark(work.reqs)
            return
        draft = ScheduleBatch(ForwardMode.DRAFT_EXTEND, work.reqs, work.ids, work.slots, work.prefix_lens,
                              work.extend_lens, [True] * len(work.reqs), positions=work.positions)
        self._set_roots(work.reqs, *self._step(draft, self.backlog.features[work.cells]))

    def _extend_graphed(self, reqs: list[Req], verified: Verified, graphs: DraftExtendGraphs) -> None:
        """on_verified through the draft-extend graph: every request padded to L tokens."""
        assert verified.features is not None and verified.kv_slots is not None, _FEATURES
        L, n = self.extend_len, verified.features.shape[1]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        feat_rows: list[int] = []
        last: list[int] = []
        starts: list[int] = []
        for b, (req, tokens) in enumerate(zip(reqs, verified.committed)):
            c, pad = len(tokens), L - len(tokens)
            start = req.kv_len - c
            ids += extend_tokens(req.all_ids, start, req.kv_len) + [0] * pad
            pos += range(start, start + L)
            slots += verified.kv_slots[b] + [0] * pad  # padding K/V: the scratch slot
            feat_rows += [b * n + i for i in verified.paths[b][:c]] + [b * n] * pad
            last.append(b * L + c - 1)
            starts.append(start)
        features = verified.features.reshape(-1, verified.features.shape[-1])
        graphs.replay_host([ids, pos, slots, feat_rows], [[r.row for r in reqs], last], features, starts)
        self.roots.mark(reqs)

    def can_draft_ahead(self, bsz: int) -> bool:
        return self.extend_graphs is not None and self.extend_graphs.can_run(bsz)

    def draft_ahead(self, reqs: list[Req], walk: GreedyWalk, features: torch.Tensor | None, slots: torch.Tensor,
                    trees: bool, row_start: torch.Tensor) -> torch.Tensor:
        """on_verified (and with `trees` the next propose) from the device, before the
        verify is read back: `walk` over full trees [B, N], features [B, N, F] their
        per-node features, slots [B, N] their slots, row_start [2B] int64 on the device the
        requests' table rows, then their kv_lens before the verify (the host's may lag:
        spec/pipeline.py). Returns kv_len after the commit [B], on the device. On CUDA one
        kernel does the bookkeeping (kernels/ahead.py)."""
        assert features is not None, _FEATURES
        b = len(reqs)
        roots, kv_lens, _, _ = self._commit_ahead(walk, features, slots, row_start, inline=False)
        self.roots.mark(reqs)
        self.trees_ahead.clear()
        if trees and self.tree.graphed(b):
            drafts = self.tree.draft_ahead(reqs, roots, kv_lens)
            if drafts is not None:
                self.trees_ahead.hold(reqs, drafts)
        return kv_lens

    def draft_ahead_inline(self, walk: GreedyWalk, features: torch.Tensor, slots: torch.Tensor,
                           row_start: torch.Tensor, scratch: torch.Tensor, tree: TreeDrafter, kv_out: torch.Tensor,
                           out: Trees) -> None:
        """draft_ahead's device work for exactly B requests, replaying no graph and touching
        no host state, so a caller's own CUDA graph can hold it (spec/eagle/step_graphs.py): the
        commit's table write, the draft extend and `tree`'s drafting pass over `scratch`
        [num_steps - 1, B*k], slots the caller keeps. Writes kv_len after the commit into
        `kv_out` [B] (which may be the tensor row_start's second half was copied from) and
        the next trees into `out` (tokens, parents, mask); the caller then calls `adopt_ahead`
        (step_graphs.py's launch)."""
        b = slots.shape[0]
        roots, _, tails, states = self._commit_ahead(walk, features, slots, row_start, inline=True,
                                                     shift=tree.shift, kv_out=kv_out)
        assert tree.graphs is not None, "step_graphs.supported: the tree pass is captured"
        tree.graphs.run_inline(roots, row_start[:b], tails, scratch, out, states)

    def whole_step(self, runner: ModelRunner, kv: KVManager, max_bs: int) -> WholeStep | None:
        """The whole pipelined step as one graph per batch size, up to step_graphs.MAX_BS."""
        if not step_graphs.supported(self):
            return None
        return step_graphs.StepGraphs(runner, self, kv, min(max_bs, step_graphs.MAX_BS))

    def adopt_ahead(self, reqs: list[Req], drafts: Drafts) -> None:
        """`reqs` have root states and `drafts` are their next trees (draft_ahead_inline's)."""
        self.roots.mark(reqs)
        self.trees_ahead.hold(reqs, drafts)

    def _commit_ahead(self, walk: GreedyWalk, features: torch.Tensor, slots: torch.Tensor, row_start: torch.Tensor,
                      inline: bool, shift: int = 0, kv_out: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, RootState | None]:
        """The commit's table write and the draft extend from a greedy walk: (roots,
        kv_lens, tails) [B], the bonus tokens, kv_len after the commit (in `kv_out` when
        given) and kv_len after + 1 - shift (a tree pass's tail starts), and the root states
        the extend wrote when it ran `inline` (unreplayed, for exactly B requests: a
        caller's capture), else None."""
        b, L = slots.shape[0], self.extend_len
        starts = row_start[b:]
        feats = features.reshape(-1, features.shape[-1])
        if not _ahead_kernel_enabled(slots):
            roots, kv_lens = self._extend_ahead(walk.paths(L), feats, slots, row_start)
            if kv_out is not None:
                kv_lens = kv_out.copy_(kv_lens)
            return roots, kv_lens, kv_lens + 1 - shift, None
        from specserve.kernels import ahead  # imports triton: CUDA only

        ext = self.extend_graphs
        assert ext is not None, "can_draft_ahead: the extend is captured"
        padded = b if inline else ext.size_for(b)
        prefix32 = ext.prefix_buffer(padded)  # the extend's attention reads it: written by the kernel
        roots, kv_lens, tails = ahead.draft_ahead_index(
            walk.on_path, walk.tokens, walk.bonus, slots, row_start, self.kv.table.table, ext.static_index(),
            padded, L, self.roots.scratch_row, shift, kv_out, prefix32)
        prefix = prefix32[:padded] if prefix32 is not None else starts
        if not inline:
            ext.replay_filled(b, feats, prefix)
            return roots, kv_lens, tails, None
        return roots, kv_lens, tails, ext.run_inline(b, feats, prefix)

    def keep_ahead(self, reqs: list[Req], rows: list[int], index: torch.Tensor) -> None:
        """The next step continues over `reqs`, rows `rows` (`index` on the device) of the
        requests drafted ahead; the others ended. Their trees are kept for its propose."""
        self.trees_ahead.keep(reqs, rows, index)

    def has_drafted_ahead(self, reqs: list[Req]) -> bool:
        """Whether the next propose over `reqs` takes trees drafted ahead (no pass of its own)."""
        return self.trees_ahead.has(reqs)

    def _extend_ahead(self, paths: DevicePaths, features: torch.Tensor, slots: torch.Tensor,
                      row_start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """draft_ahead's bookkeeping and extend with torch ops (the kernel's reference):
        returns the bonus tokens and kv_len after the commit, [B] each. Padding past a
        request's path is what `_extend_graphed` pads with (token 0, slot 0, its row-0
        feature)."""
        (b, L), n = paths.nodes.shape, slots.shape[1]
        dev = slots.device
        rows, start = row_start[:b], row_start[b:]
        col = torch.arange(L, device=dev)
        committed = col < paths.lens[:, None]  # [B, L]
        pos = start[:, None] + col
        kept = torch.where(committed, slots.gather(1, paths.nodes), 0)  # path order; padding: scratch slot 0
        # the commit's table write (commit_kv skips it): the extend reads its K/V through the table
        table, cells = self.kv.table.table, (rows[:, None].expand(b, L), pos)
        table[cells] = torch.where(committed, kept, table[cells])
        feat_rows = torch.arange(b, device=dev)[:, None] * n + torch.where(committed, paths.nodes, 0)
        last = torch.arange(b, device=dev) * L + paths.lens - 1
        index = [torch.where(committed, paths.tokens, 0).reshape(-1), pos.reshape(-1), kept.reshape(-1),
                 feat_rows.reshape(-1), rows, last]
        assert self.extend_graphs is not None, "can_draft_ahead: the extend is captured"
        self.extend_graphs.replay(index, features, start)
        return paths.tokens.gather(1, (paths.lens - 1)[:, None])[:, 0], start + paths.lens

    def _set_roots(self, reqs: list[Req], logits: torch.Tensor, hidden: torch.Tensor) -> None:
        self.roots.set(reqs, *top_children(logits, self.topk, self.token_map), hidden)

    # -- drafting -------------------------------------------------------------------------
    def propose(self, reqs: list[Req], budgets: list[int]) -> Drafts:
        self._catch_up(reqs)  # after plain steps
        nodes = max(budgets)  # the batch tree's N for a step graph's run of it (batch_tree.py), else max_nodes
        ahead = self.trees_ahead.take(reqs, nodes)
        if ahead is not None and min(budgets) > 1:
            return ahead
        active = [b for b, n in enumerate(budgets) if n > 1]  # budget 1: root only
        if not active:
            return Drafts.roots([r.last_id for r in reqs], self.runner.device)
        act, drafter = [reqs[b] for b in active], self.drafter(nodes)
        if drafter.graphed(len(act)):
            tree = drafter.draft(act, nodes)  # the graph reads the root states itself
        else:
            logp, ids, hidden = self.roots.get(h2d([r.row for r in act], self.runner.device))
            tree = drafter.draft(act, nodes, (logp[:, :drafter.topk], ids[:, :drafter.topk]), hidden)
        if len(act) == len(reqs):
            return tree
        return Drafts.roots([r.last_id for r in reqs], self.runner.device).with_rows(active, tree)

    def _can_capture(self, runner: ModelRunner) -> bool:
        """Graphs on CUDA (unless --disable-cuda-graph) when the draft's backend can run in them."""
        return runner.device.type == "cuda" and not runner.runner_cfg.disable_cuda_graph \
            and self.backend.supports_cuda_graph

    def _capture_tree(self, runner: ModelRunner, max_running: int, tree: TreeDrafter | None = None,
                      nodes: int | None = None) -> TreeDraftGraphs:
        """One graph per batch size for the whole tree-drafting pass of `tree` (default:
        the main tree, of max_nodes nodes)."""
        with torch.inference_mode():
            return TreeDraftGraphs(tree or self.tree, self.roots, runner.graph_max_bs(max_running),
                                   nodes or self.max_nodes, runner.device)

    def _batch_tree(self, spec: SpecConfig) -> tuple[TreeDrafter | None, int]:
        """The batch tree's drafter (same head, root states and scratch) and its N; (None, 0) when off."""
        shape = batch_tree.parse_tree(spec.batch_tree if spec.batch_tree != batch_tree.AUTO else batch_tree.OFF)
        if shape is None:
            return None, 0
        batch_tree.check_against(batch_tree.TreeShape(*spec.tree), shape)
        logger.info("Batch tree %s (steps, topk, draft tokens) for step graphs of %d requests and more",
                    shape, spec.batch_tree_from)
        drafter = TreeDrafter(self.kv, self._tree_step, shape.topk, shape.steps, shift=1, token_map=self.token_map)
        return drafter, shape.nodes

    def drafter(self, nodes: int) -> TreeDrafter:
        """The drafter of trees of `nodes` nodes: the batch tree's, or the main tree's."""
        return self.batch_tree if self.batch_tree is not None and nodes == self.batch_nodes else self.tree

    def _capture_extend(self, runner: ModelRunner, max_running: int, tokens_per_req: int,
                        backend=None) -> DraftExtendGraphs:
        """One graph per batch size for the draft extend of `tokens_per_req` tokens per request
        (and the root states it leaves), on `backend` (default: the draft's own)."""
        with torch.inference_mode():
            return DraftExtendGraphs(self.model, backend or self.backend, self.pool, self.kv.table.table,
                                     runner.graph_max_bs(max_running), tokens_per_req, self._feature_width(runner),
                                     self.topk, self.token_map, self.roots)

    def _capture_prefill(self, runner: ModelRunner, max_running: int) -> DraftPrefillGraphs | None:
        """Graphs of the draft prefill of a chunk of up to `max_running` requests, at the
        target's prefill-graph sizes (none when --cuda-graph-max-prefill-tokens turns those off)."""
        if not prefill_sizes(runner.prefill_graph_max_tokens()):
            return None
        with torch.inference_mode():
            return DraftPrefillGraphs(self.model, self.backend, self.pool, self.kv.table.table,
                                      runner.prefill_graph_max_tokens(), self._feature_width(runner), self.topk,
                                      self.token_map, self.roots, max_reqs=max_running)

    def _feature_width(self, runner: ModelRunner) -> int:
        hidden = runner.model.config.hidden_size
        return hidden * len(self.model.aux_layers) if self.model.feature_mode == "aux" else hidden

    @torch.inference_mode()
    def _step(self, batch: ScheduleBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One eager draft forward (DRAFT_EXTEND): (logits [R, V_draft], next hidden [R, H])
        at the batch's logit rows (the last token of each sampled request)."""
        fb = self.runner.forward_batch(batch, self.kv.table.table, kv_pool=self.pool)
        fb.attn_backend = self.backend
        self.backend.init_forward_metadata(fb)
        h_logits, h_next = self.model(fb, hidden)
        rows = fb.logit_rows
        return self.model.compute_logits(h_logits[rows]), h_next[rows]

    @torch.inference_mode()
    def _tree_step(self, frame: TreeStep, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One tree-drafting forward over a frontier (eager, or inside the tree graph)."""
        fb = frontier_batch(frame, self.kv.table.table, self.pool, self.backend)
        h_logits, h_next = self.model(fb, hidden)
        return self.model.compute_logits(h_logits), h_next


def _ahead_kernel_enabled(t: torch.Tensor) -> bool:
    """draft_ahead's bookkeeping as one Triton launch: on CUDA (tests also force it on the
    CPU, under TRITON_INTERPRET)."""
    return kernels.use_fused(t)


def _token_map(spec: SpecConfig, runner: ModelRunner) -> torch.Tensor | None:
    if spec.token_map is None:  # EAGLE3: cleared at start-up (its head has its own draft vocabulary)
        return None
    return load_token_map(spec.token_map, runner.vocab_size)
