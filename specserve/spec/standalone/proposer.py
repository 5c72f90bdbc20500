"""STANDALONE: a small LLM with the target's vocabulary drafts a chain (topk 1) or a tree.

The draft has its own KV pool addressed by the target's slots and table, so it needs no
allocation of its own; past the target's slots it has one root slot per table row
(ahead.py). Per request it tracks `draft_kv_len`: positions below it hold valid draft
KV in the slots the table row gives them. Each step:
  1. a catch-up forward over [draft_kv_len, kv_len] (the committed tokens it has not
     seen, then the root, whose KV goes into its verify slot, already in the table)
     leaves the root's top-k children in `RootStates`;
  2. `tree.draft.TreeDrafter` expands a tree (a chain: topk 1) on scratch slots, each
     branch attending to the request's row plus its own ancestors.
After verify the root keeps its draft KV (draft_kv_len = kv_len at propose + 1).
Drafting is greedy: verification treats drafts as one-hot, which is what makes sampling
lossless. With an FR-Spec token map (`--speculative-token-map`) the draft's lm_head holds
the map's rows only, and every pick (catch-up, tree pass) is mapped back to a token id.

Nothing is read back inside a step: the drafts stay on the device, and the catch-up's
slots are gathered from the table there. On CUDA the catch-up (num_steps + 2 tokens per
request a replay; up to CATCH_UP_ROUNDS replays in turn after the governor's plain
steps; longer ones, a prompt's, run eagerly) and the whole tree pass replay CUDA graphs
(`tree/extend_graphs.py`, `tree/graphs.py`); a draft of tens of layers is hundreds of
launches a forward.

Drafting ahead (spec/pipeline.py: CUDA graphs, greedy walks): `draft_ahead` runs between
a verify's walk and its read-back. It writes the committed positions' slots into the
table rows, catches the draft up through the bonus token (the next root, whose KV goes
into the row's root slot: ahead.py) and queues the next trees; the host then reads the
step back while the GPU drafts, and the next step's verify is launched before this one
is committed. draft_kv_len after it is the new kv_len: the next root is fed again by the
next catch-up, into its verify slot.
"""
from __future__ import annotations

import torch

from specserve.cache.kv_pool import KVPool
from specserve.core.batch import ScheduleBatch
from specserve.core.config import SpecConfig
from specserve.core.forward_batch import ForwardBatch, ForwardMode
from specserve.core.h2d import h2d, h2d_many
from specserve.core.request import Req
from specserve.engine.kv_manager import KVManager
from specserve.engine.speculation import Decoded
from specserve.models.llama import LlamaConfig
from specserve.models.loader import load_model, random_model, read_hf_config
from specserve.models.quantization import draft_flag
from specserve.models.token_map import load_token_map, truncate_head
from specserve.runner.model_runner import ModelRunner, make_backend
from specserve.spec.accept import GreedyWalk
from specserve.spec.drafts import Drafts
from specserve.spec.proposer import DraftsAhead, Proposer, Verified
from specserve.spec.standalone.ahead import catch_up_ahead
from specserve.spec.tree.ahead import TreesAhead
from specserve.spec.tree.draft import TreeDrafter, TreeStep, frontier_batch, top_children
from specserve.spec.tree.extend_graphs import DraftExtendGraphs
from specserve.spec.tree.graphs import TreeDraftGraphs
from specserve.spec.tree.root_states import RootStates

Span = tuple[int, int]  # positions [start, end) a request's catch-up feeds
# A catch-up of up to this many graph replays runs graphed (a longer one eagerly: a prompt's):
# an eager forward of a draft of tens of layers costs more launches than several replays.
CATCH_UP_ROUNDS = 8


def kv_shape(spec: SpecConfig) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of the draft's own KV pool, which has a slot for each
    of the target's: the runner sizes its KV budget with it before the draft loads."""
    c = LlamaConfig.from_hf(read_hf_config(spec.draft_path))
    return c.num_layers, c.kv_heads_per_rank, c.head_dim


class StandaloneProposer(Proposer, DraftsAhead):
    def __init__(self, spec: SpecConfig, runner: ModelRunner, kv: KVManager, max_running: int) -> None:
        path = spec.draft_path  # checked at start-up (spec/standalone: resolve)
        load = random_model if spec.draft_load_format == "dummy" else load_model  # random weights: benchmarks
        self.model = load(path, runner.dtype, runner.device,
                          draft_flag(spec.draft_model_quantization, runner.model.weight_quant))
        c = self.model.config
        # FR-Spec: the draft's head cut to the map's rows; its picks mapped back to token ids
        self.token_map = truncate_head(self.model, load_token_map(spec.token_map, runner.vocab_size)) \
            if spec.token_map is not None else None
        self.runner, self.kv, self.table = runner, kv, kv.table.table
        rows = self.table.shape[0]
        # the target's slots, then a root slot per table row (ahead.py): root_slot0 + row
        self.pool = KVPool(runner.num_slots + rows, c.num_layers, c.kv_heads_per_rank, c.head_dim, runner.kv_dtype,
                           runner.device)
        self.root_slot0 = runner.num_slots + 1
        self.backend = make_backend(spec.draft_attention_backend or runner.attn_backend_name, runner.device)
        self.num_steps, self.topk, self.max_nodes = spec.tree
        # topk 1: a chain
        self.tree = TreeDrafter(kv, self._tree_step, self.topk, self.num_steps, token_map=self.token_map)
        self.scratch_per_req = self.topk * (self.num_steps - 1)
        self.roots = RootStates(rows, self.topk, 0, runner.dtype, runner.device)
        self.catch_up_len = self.num_steps + 2  # a step's root, its accepted nodes and the bonus (ahead.py)
        self.extend_graphs: DraftExtendGraphs | None = None  # the catch-up
        self.draft_kv_len: dict[str, int] = {}
        self._fed: dict[str, int] = {}  # rid -> kv_len at a propose that fed the root into its verify slot
        self.trees_ahead = TreesAhead()  # the next propose's trees, drafted ahead
        if runner.device.type == "cuda" and not runner.runner_cfg.disable_cuda_graph \
                and self.backend.supports_cuda_graph:
            self._capture(runner.graph_max_bs(max_running))

    def _capture(self, max_bs: int) -> None:
        """Graphs of the catch-up and of the drafting pass."""
        with torch.inference_mode():
            self.extend_graphs = DraftExtendGraphs(self.model, self.backend, self.pool, self.table, max_bs,
                                                   self.catch_up_len, 0, self.topk, self.token_map, self.roots,
                                                   table_slots=True)
            if self.num_steps > 1:
                self.tree.graphs = TreeDraftGraphs(self.tree, self.roots, max_bs, self.max_nodes, self.runner.device)

    def add_request(self, req: Req) -> None:
        self.draft_kv_len[req.rid] = 0  # a cached prefix may lack draft KV: recompute it

    def remove_request(self, req: Req) -> None:
        self.draft_kv_len.pop(req.rid, None)
        self._fed.pop(req.rid, None)
        if not req.finished:  # retracted: it comes back under its id, and its tree drafted ahead is stale
            self.trees_ahead.clear()

    def cacheable(self, req: Req) -> int | None:
        return None  # a borrower recomputes its draft KV (add_request)

    def propose(self, reqs: list[Req], budgets: list[int]) -> Drafts:
        ahead = self.trees_ahead.take(reqs, self.max_nodes)
        if ahead is not None and min(budgets) > 1:
            return ahead  # the root's draft KV is in its root slot: nothing fed is kept
        active = [b for b, n in enumerate(budgets) if n > 1]  # budget 1: root only (penalties)
        if not active:
            return Drafts.roots([r.last_id for r in reqs], self.runner.device)
        act = [reqs[b] for b in active]
        drafts = self._draft_tree(act, self._catch_up(act))
        for req in act:
            self._fed[req.rid] = req.kv_len
        if len(act) == len(reqs):
            return drafts
        return Drafts.roots([r.last_id for r in reqs], self.runner.device).with_rows(active, drafts)

    def on_extend(self, batch: ScheduleBatch, features: torch.Tensor | None) -> None:
        pass  # the draft catches up lazily in propose()

    def on_verified(self, reqs: list[Req], verified: Verified) -> None:
        for req in reqs:
            fed = self._fed.pop(req.rid, None)
            if verified.extended:  # draft_ahead fed the committed tokens, the next root into its root slot
                self.draft_kv_len[req.rid] = req.kv_len
            elif fed is not None:  # the root's draft KV is in its verify slot, which the commit keeps
                self.draft_kv_len[req.rid] = fed + 1

    def on_decoded(self, reqs: list[Req], step: Decoded) -> None:
        self.trees_ahead.clear()  # trees drafted ahead are from before this token; the draft catches up in propose()

    # -- drafting ahead (pipeline.py) -------------------------------------------------------
    def can_draft_ahead(self, bsz: int) -> bool:
        return self.extend_graphs is not None and self.extend_graphs.can_run(bsz) and self.tree.graphed(bsz)

    def draft_ahead(self, reqs: list[Req], walk: GreedyWalk, features: torch.Tensor | None, slots: torch.Tensor,
                    trees: bool, row_start: torch.Tensor) -> torch.Tensor:
        """The commit's table writes, the catch-up through the bonus and (with `trees`) the
        next trees, queued from the walk before the verify is read back (ahead.py)."""
        g = self.extend_graphs
        assert g is not None, "can_draft_ahead: the catch-up is captured"
        work = catch_up_ahead(walk, slots, row_start, self.table, self.root_slot0, g.L)
        g.replay(work.inputs, None, work.prefix)
        self.roots.mark(reqs)
        self.trees_ahead.clear()
        if trees:
            drafts = self.tree.draft_ahead(reqs, work.roots, work.kv_after)
            if drafts is not None:
                self.trees_ahead.hold(reqs, drafts)
        return work.kv_after

    def keep_ahead(self, reqs: list[Req], rows: list[int], index: torch.Tensor) -> None:
        self.trees_ahead.keep(reqs, rows, index)

    def has_drafted_ahead(self, reqs: list[Req]) -> bool:
        return self.trees_ahead.has(reqs)

    # -- the catch-up ---------------------------------------------------------------------
    def _catch_up(self, reqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Feed each request's unseen committed tokens and its root. Returns the roots'
        children (logp, ids) [B, k], or None when a graph wrote them into `self.roots`."""
        spans = [(self.draft_kv_len[r.rid], r.kv_len + 1) for r in reqs]
        g = self.extend_graphs
        if g is not None and g.can_run(len(reqs)) and max(e - s for s, e in spans) <= g.L * CATCH_UP_ROUNDS:
            self._catch_up_in_rounds(reqs, spans)
            return None
        return self._catch_up_eager(reqs, spans)

    def _catch_up_in_rounds(self, reqs: list[Req], spans: list[Span]) -> None:
        """Spans of up to L tokens in one replay; longer ones (after the governor's plain
        steps) in rounds of L: each round feeds the next L tokens of every span not yet
        fed, so a request's root states are written by the round that holds its last
        token (an earlier round's are overwritten)."""
        assert self.extend_graphs is not None, "graphed: the catch-up is captured"
        L = self.extend_graphs.L
        while reqs:
            chunks = [(s, min(e, s + L)) for s, e in spans]
            self._catch_up_graphed(reqs, chunks)
            left = [i for i, ((_, e), (_, c)) in enumerate(zip(spans, chunks)) if c < e]
            reqs, spans = [reqs[i] for i in left], [(chunks[i][1], spans[i][1]) for i in left]

    def _catch_up_graphed(self, reqs: list[Req], spans: list[Span]) -> None:
        """The catch-up padded to L tokens a request (padding: token 0 at position 0 into
        the scratch slot 0, after the request's own tokens, so none of them attends to it)."""
        g, stride = self.extend_graphs, self.table.stride(0)
        assert g is not None, "graphed: the catch-up is captured"
        ids: list[int] = []
        pos: list[int] = []
        index: list[int] = []
        last: list[int] = []
        for b, (req, (s, e)) in enumerate(zip(reqs, spans)):
            pad = [0] * (g.L - (e - s))
            ids += req.all_ids[s:e] + pad
            pos += list(range(s, e)) + pad
            index += [req.row * stride + p for p in range(s, e)] + [-1] * len(pad)
            last.append(b * g.L + e - s - 1)
        g.replay_host([ids, pos, index, [0] * len(ids)], [[r.row for r in reqs], last], None, [s for s, _ in spans])

    def _catch_up_eager(self, reqs: list[Req], spans: list[Span]) -> tuple[torch.Tensor, torch.Tensor]:
        stride = self.table.stride(0)
        ids: list[int] = []
        pos: list[int] = []
        index: list[int] = []
        for req, (s, e) in zip(reqs, spans):
            ids += req.all_ids[s:e]
            pos += range(s, e)
            index += [req.row * stride + p for p in range(s, e)]
        lens = [e - s for s, e in spans]
        last = torch.tensor(lens).cumsum(0) - 1
        ids_d, pos_d, index_d, rows, last_d = h2d_many([ids, pos, index, [r.row for r in reqs], last],
                                                        self.runner.device)
        fb = ForwardBatch(ForwardMode.DRAFT_EXTEND, ids_d, pos_d, self.table.view(-1)[index_d], rows,
                          [s for s, _ in spans], lens, self.table, self.pool, self.backend, logit_rows=last_d)
        return top_children(self._logits(fb), self.topk, self.token_map)

    # -- drafting -------------------------------------------------------------------------
    def _draft_tree(self, reqs: list[Req], first: tuple[torch.Tensor, torch.Tensor] | None) -> Drafts:
        """Trees (chains at topk 1) from the root states: `first` the roots' children, or
        None when a graph wrote them into `self.roots`."""
        if self.tree.graphed(len(reqs)):  # the graph reads the root states
            if first is not None:
                self.roots.write(h2d([r.row for r in reqs], self.runner.device), *first, None)
            return self.tree.draft(reqs, self.max_nodes)
        if first is None:
            first = self.roots.get(h2d([r.row for r in reqs], self.runner.device))[:2]
        return self.tree.draft(reqs, self.max_nodes, first)

    @torch.inference_mode()
    def _tree_step(self, frame: TreeStep, states: None) -> tuple[torch.Tensor, None]:
        fb = frontier_batch(frame, self.table, self.pool, self.backend)
        hidden, _ = self.model(fb)
        return self.model.compute_logits(hidden), None

    @torch.inference_mode()
    def _logits(self, fb: ForwardBatch) -> torch.Tensor:
        """The draft's float32 logits at fb.logit_rows, eagerly."""
        self.backend.init_forward_metadata(fb)
        hidden, _ = self.model(fb)
        return self.model.compute_logits(hidden[fb.logit_rows])
