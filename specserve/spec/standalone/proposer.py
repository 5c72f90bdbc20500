"""STANDALONE: a small LLM with the target's vocabulary drafts a chain (topk 1) or a tree.

The draft has its own KV pool addressed by the target's slots and table, so it needs no
allocation of its own. Per request it tracks `draft_kv_len`: positions below it hold
valid draft KV. Each step:
  1. a catch-up forward over [draft_kv_len, kv_len] (the committed tokens it has not
     seen, then the root) leaves the root's top-k children in `RootStates`;
  2. a chain feeds d1, d2, ... at positions kv_len + 1, ... (DECODE forwards), writing
     their KV into the verify slots of chain nodes 1, 2, ... (already in the table); a
     tree (topk > 1) is expanded by `tree_draft.TreeDrafter` on scratch slots (each
     branch attends to the request's row plus its own ancestors), and only the root's
     draft KV is kept.
After verify the first min(committed, fed) nodes keep valid draft KV, because accepted
chain nodes stay at their positions. Drafting is greedy: verification treats drafts as
one-hot, which is what makes sampling lossless.

Nothing is read back inside a step: the drafts stay on the device, and the slots of the
catch-up and of the chain's nodes are gathered from the table there. On CUDA the
catch-up (num_steps + 1 tokens per request a replay: what one verify commits; up to
CATCH_UP_ROUNDS replays in turn after the governor's plain steps; longer ones, a
prompt's, run eagerly), each chain DECODE and the
whole tree pass replay CUDA graphs (`extend_graphs.py`, `runner/cuda_graph.py`,
`tree_graphs.py`); a draft of tens of layers is hundreds of launches a forward.
"""
from __future__ import annotations

import torch

from specserve.cache.kv_pool import KVPool
from specserve.cache.req_table import slots_at
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
from specserve.runner.cuda_graph import CudaGraphRunner
from specserve.runner.model_runner import ModelRunner, make_backend
from specserve.spec.drafts import Drafts
from specserve.spec.proposer import Proposer, Verified
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


class StandaloneProposer(Proposer):
    def __init__(self, spec: SpecConfig, runner: ModelRunner, kv: KVManager, max_running: int) -> None:
        path = spec.draft_path  # checked at start-up (spec/standalone: resolve)
        load = random_model if spec.draft_load_format == "dummy" else load_model  # random weights: benchmarks
        self.model = load(path, runner.dtype, runner.device,
                          draft_flag(spec.draft_model_quantization, runner.model.weight_quant))
        c = self.model.config
        self.pool = KVPool(runner.num_slots, c.num_layers, c.kv_heads_per_rank, c.head_dim, runner.kv_dtype,
                           runner.device)
        self.backend = make_backend(spec.draft_attention_backend or runner.attn_backend_name, runner.device)
        self.runner, self.kv, self.table = runner, kv, kv.table.table
        self.num_steps, self.topk, self.max_nodes = spec.tree
        self.tree = TreeDrafter(kv, self._tree_step, self.topk, self.num_steps) if self.topk > 1 else None
        self.scratch_per_req = self.topk * (self.num_steps - 1) if self.tree else 0
        self.roots = RootStates(self.table.shape[0], self.topk, 0, runner.dtype, runner.device)
        self.catch_up_len = self.num_steps + 1  # the most tokens one verify commits
        self.extend_graphs: DraftExtendGraphs | None = None  # the catch-up
        self.decode_graphs: CudaGraphRunner | None = None  # a chain's DECODE forwards
        self.draft_kv_len: dict[str, int] = {}
        self._fed: dict[str, tuple[int, int]] = {}  # rid -> (kv_len at propose, nodes whose draft KV was written)
        if runner.device.type == "cuda" and not runner.runner_cfg.disable_cuda_graph \
                and self.backend.supports_cuda_graph:
            self._capture(runner.graph_max_bs(max_running))

    def _capture(self, max_bs: int) -> None:
        """Graphs of the catch-up, and of the tree pass or the chain's DECODE forwards."""
        dev = self.runner.device
        with torch.inference_mode():
            self.extend_graphs = DraftExtendGraphs(self.model, self.backend, self.pool, self.table, max_bs,
                                                   self.catch_up_len, 0, self.topk, None, self.roots,
                                                   table_slots=True)
            if self.tree is not None:
                self.tree.graphs = TreeDraftGraphs(self.tree, self.roots, max_bs, self.max_nodes, dev)
            elif self.num_steps > 1:
                self.decode_graphs = CudaGraphRunner(self.model, self.backend, self.runner.vocab_size, dev, max_bs)
                zero = torch.zeros(1, dtype=torch.int64, device=dev)
                self.decode_graphs.capture(ForwardBatch(ForwardMode.DECODE, zero, zero, zero, zero, [0], [1],
                                                        self.table, self.pool, self.backend))

    def add_request(self, req: Req) -> None:
        self.draft_kv_len[req.rid] = 0  # a cached prefix may lack draft KV: recompute it

    def remove_request(self, req: Req) -> None:
        self.draft_kv_len.pop(req.rid, None)
        self._fed.pop(req.rid, None)

    def cacheable(self, req: Req) -> int | None:
        return None  # a borrower recomputes its draft KV (add_request)

    def propose(self, reqs: list[Req], budgets: list[int]) -> Drafts:
        for req in reqs:
            self._fed[req.rid] = (req.kv_len, 0)
        active = [b for b, n in enumerate(budgets) if n > 1]  # budget 1: root only (penalties)
        if not active:
            return Drafts.roots([r.last_id for r in reqs], self.runner.device)
        act = [reqs[b] for b in active]
        first = self._catch_up(act)
        if self.tree is not None:
            drafts, fed = self._draft_tree(act, first), [1] * len(act)
        else:
            counts = [min(budgets[b], self.num_steps + 1) for b in active]  # nodes, root included
            drafts, fed = self._draft_chain(act, counts, first), [n - 1 for n in counts]
        for req, n in zip(act, fed):
            self._fed[req.rid] = (req.kv_len, n)
        if len(act) == len(reqs):
            return drafts
        return Drafts.roots([r.last_id for r in reqs], self.runner.device).with_rows(active, drafts)

    def on_extend(self, batch: ScheduleBatch, features: torch.Tensor | None) -> None:
        pass  # the draft catches up lazily in propose()

    def on_verified(self, reqs: list[Req], verified: Verified) -> None:
        for req, tokens in zip(reqs, verified.committed):
            kv_len, fed = self._fed.pop(req.rid)
            if fed:
                self.draft_kv_len[req.rid] = kv_len + min(len(tokens), fed)

    def on_decoded(self, reqs: list[Req], step: Decoded) -> None:
        pass  # the draft catches up lazily in propose()

    def can_draft_ahead(self, bsz: int) -> bool:
        return False  # it catches up from host ids in propose()

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
        return top_children(self._logits(fb), self.topk, None)

    # -- drafting -------------------------------------------------------------------------
    def _draft_chain(self, reqs: list[Req], counts: list[int],
                     first: tuple[torch.Tensor, torch.Tensor] | None) -> Drafts:
        """Chains of counts[b] nodes: d1 from the catch-up, then DECODE forwards that feed
        chain node s (d_s at kv_len + s, KV into its verify slot) for d_{s+1}. A request
        whose chain is complete feeds into the scratch slot 0 instead (its outputs unused)."""
        b, dev, stride = len(reqs), self.runner.device, self.table.stride(0)
        feeds = range(1, max(counts) - 1)
        pos = [[r.kv_len + s for r in reqs] for s in feeds]
        index = [[r.row * stride + r.kv_len + s if s < n - 1 else -1 for r, n in zip(reqs, counts)] for s in feeds]
        rows, pos_d, index_d = h2d_many([[r.row for r in reqs], sum(pos, []), sum(index, [])], dev)
        drafted = [first[1][:, 0] if first is not None else self.roots.ids[rows, 0]]
        if feeds:
            slots = slots_at(self.table, index_d).view(len(feeds), b)
            pos_d = pos_d.view(len(feeds), b)
            for i in range(len(feeds)):
                fb = ForwardBatch(ForwardMode.DECODE, drafted[-1], pos_d[i], slots[i], rows, pos[i], [1] * b,
                                  self.table, self.pool, self.backend, logit_rows=self.runner.arange(b))
                drafted.append(self._logits(fb).argmax(-1))
        return Drafts.device_chains([r.last_id for r in reqs], torch.stack(drafted, 1), counts)

    def _draft_tree(self, reqs: list[Req], first: tuple[torch.Tensor, torch.Tensor] | None) -> Drafts:
        assert self.tree is not None, "trees for topk > 1"
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
        """The draft's float32 logits at fb.logit_rows (a DECODE through its graph when captured)."""
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(fb):
            return graphs.replay(fb)[0]
        self.backend.init_forward_metadata(fb)
        hidden, _ = self.model(fb)
        return self.model.compute_logits(hidden[fb.logit_rows])
