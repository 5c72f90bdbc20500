"""One CUDA graph per batch size for a whole pipelined speculative step (EAGLE).

A pipelined step (pipeline.py) replays three graphs (verify, draft extend, tree pass) and
around them the host issues some forty launches with their Python: the table block, the
positions, the verify's metadata, the argmax and walk, the draft-ahead kernel, the tree
pass's inputs and scratch slots. At batch 1 that host work outlasts the GPU's, so the
GPU waits. Here the whole step is one graph per batch size:

  table block <- verify slots; positions = kv_len + depth (both one launch:
  verify_prologue.py); VERIFY forward over the trees
  drafted last step (logits, features); greedy walk; draft-ahead bookkeeping (the
  commit's table write, the extend's inputs); draft extend (root states); tree pass ->
  next trees; kv_len <- kv_len after the commit.

and a step on the host is: allocate the verify slots, one host->device copy (table rows
and slots), one replay, the walk's copy back.

State carried from one replay to the next in static buffers: the trees (`tokens`,
`parents`, `mask`) and each request's kv_len. The first step of a run (nothing in
flight) writes them from the host's kv_len and the proposer's trees; a continuing step
(the same requests, pipeline.py) finds them where the last replay left them (or, when
some requests ended, `keep_rows` first moves the others' rows to the front), and the
proposer is handed views of the new trees (`adopt_ahead`), so a step that drains first
still finds them. The tree pass drafts into scratch slots reserved for the server's
lifetime (`KVManager.reserve`), so a step allocates nothing for it.

Captured sizes (`step_sizes`): every batch size up to EXACT, then the graph ladder up to
MAX_BS, where a batch of b replays the smallest size g >= b. Its rows [b, g) are padding
requests: table row `pad_row` (never handed out: cache/req_table.py), verify slots the
scratch slot 0, and kv_len 0 and output-index offset 0 at each replay's start (rows left
by ended requests or by a larger replay hold stale state; the graph clears it), so a
padding request reads and writes only the pad row, slot 0 and the root states' and
trees' padding rows, and the host reads only rows [0, b) of the walk. Sizes go up to
MAX_BS: above it the GPU's verify work, not the host's launches, sets a step's pace.

With a batch tree (batch_tree.py), sizes from the proposer's `batch_from` up draft and
verify it instead of the main tree: each shape keeps its own static trees (`_Trees`), a
run keeps one shape (`launch` asserts it), and the target's attention backend keeps verify
graph state per N.

Sampled steps (temperature, top-k, top-p and min-p; no penalties or logprobs) have
graphs of their own: the walk runs over `gumbel_targets`, the target logits above each
node's filter floor plus the Gumbel noise plain sampling would draw at each node's output
index, so they reproduce seeded plain sampling token for token as the unpipelined step
does (worker.py `_accept`). On CUDA a few launches find the floors (kernels/filters.py;
a request without filters costs a parameter read there) and the walk's argmax kernel
forms the targets as it reads the logits (kernels/argmax.py), so neither the noise nor
the targets are stored. The output index is
kv_len minus a per-request offset (kv_len - len(output_ids), fixed for a request's life),
so the graph derives it from the kv_len it carries.

On a CPU (tests) the same body runs eagerly with host-built metadata (`capture` False).
"""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

from specserve.core.request import Req
from specserve.engine.kv_manager import KVManager
from specserve.runner.cuda_graph import capture_each, capture_sizes
from specserve.runner.model_runner import ModelRunner
from specserve.runner.sampler import HostFlags, SamplingBatch
from specserve.spec.accept import walk_greedy
from specserve.spec.drafts import Drafts
from specserve.spec.eagle.verify_prologue import verify_prologue
from specserve.spec.tree.draft import TreeDrafter

if TYPE_CHECKING:
    from specserve.spec.eagle.proposer import EagleProposer

_FILTERED = HostFlags(all_greedy=False, needs_sort=True, needs_min_p=True)  # rows without filters cost nothing
EXACT = 8  # every batch size up to this has a graph of its own (padding costs most there)
MAX_BS = 64  # the largest step graph: above it the GPU's verify work sets a step's pace


def step_sizes(max_bs: int, exact: int = EXACT) -> list[int]:
    """The captured batch sizes: 1..exact, then the graph ladder's sizes up to max_bs."""
    return sorted({*range(1, min(exact, max_bs) + 1), *(s for s in capture_sizes(max_bs) if s > exact)})


def supported(proposer: EagleProposer) -> bool:
    """Whether `proposer` can draft inside a step graph: extend and tree graphs captured
    (and the batch tree's, when it has one), and trees that fill all N nodes."""
    if proposer.extend_graphs is None or proposer.tree.graphs is None:
        return False
    if proposer.batch_tree is not None and proposer.batch_tree.graphs is None:
        return False
    return proposer.tree.num_selected(proposer.max_nodes) == proposer.max_nodes - 1


class _Trees:
    """One tree shape's state carried from one replay to the next (static buffers): the
    trees drafted for the next step, over max_bs requests of n nodes, and the drafting
    pass's scratch slots [steps - 1, max_bs * k]."""

    def __init__(self, drafter: TreeDrafter, n: int, max_bs: int, scratch: torch.Tensor,
                 mask_buffer: torch.Tensor | None = None) -> None:
        """`mask_buffer`: the attention backend's own tree masks [>= max_bs, n, n], where the
        masks are kept so that the verify reads them in place (no copy a step)."""
        self.drafter, self.n, dev = drafter, n, scratch.device
        # Trees start as stars (every node the root's child, token 0), as a padding request
        # that no real one ever left finds them: depth 1, so its walk commits at most 2
        # tokens, within the draft extend's steps + 1 a request (eagle.py `extend_len`).
        self.tokens = torch.zeros(max_bs, n, dtype=torch.int64, device=dev)
        self.parents = torch.zeros(max_bs, n, dtype=torch.int64, device=dev)
        self.parents[:, 0] = -1
        star = torch.eye(n, dtype=torch.bool, device=dev)
        star[:, 0] = True
        if mask_buffer is not None and mask_buffer.shape[0] >= max_bs:
            self.mask = mask_buffer[:max_bs]
            self.mask.copy_(star.expand(max_bs, n, n))
        else:
            self.mask = star.expand(max_bs, n, n).clone()
        self.valid = torch.ones(max_bs, n, dtype=torch.bool, device=dev)
        width = drafter.topk * (drafter.num_steps - 1)
        self.scratch = scratch[:max_bs * width].view(drafter.num_steps - 1, max_bs * drafter.topk)

    def drafts(self, b: int) -> Drafts:
        """The first b requests' trees (views of the static buffers)."""
        return Drafts(self.tokens[:b], self.parents[:b], self.valid[:b], [self.n] * b, self.mask[:b])


class StepGraphs:
    def __init__(self, runner: ModelRunner, proposer: EagleProposer, kv: KVManager, max_bs: int,
                 capture: bool = True, exact: int = EXACT) -> None:
        """Graphs for batches up to `max_bs`, one per `step_sizes(max_bs, exact)`; `capture`
        False runs the same body eagerly (CPU tests). Sizes from the proposer's batch_from
        up draft its batch tree, when it has one (batch_tree.py)."""
        self.runner, self.proposer, self.kv, self.capture = runner, proposer, kv, capture
        self.max_bs, self.sizes, self.pad_row = max_bs, step_sizes(max_bs, exact), kv.table.pad_row
        dev = runner.device
        drafters = [(proposer.tree, proposer.max_nodes)]
        if proposer.batch_tree is not None:
            drafters.append((proposer.batch_tree, proposer.batch_nodes))
        # one reservation, shared: a step drafts one tree, and the main tree's is the larger
        scratch = kv.reserve(max_bs * proposer.scratch_per_req).to(dev)
        if capture:  # the verify's graph metadata for the batch tree's N (the runner made the main tree's)
            for _, n in drafters[1:]:
                runner.attn_backend.init_cuda_graph_state(max_bs, n)
        masks = getattr(runner.attn_backend, "verify_mask_buffer", None) if capture else None
        self._trees = [_Trees(d, n, max_bs, scratch, masks(n) if masks is not None else None) for d, n in drafters]
        self._last = self._trees[0]  # the trees of the last replay
        n = max(t.n for t in self._trees)
        # per replay of size b: table rows io[:b], then verify slots io[b:b + b*N] (one copy)
        self.io = torch.zeros(max_bs * (n + 1), dtype=torch.int64, device=dev)
        self.kv_len = torch.zeros(max_bs, dtype=torch.int64, device=dev)  # before the step; after, once replayed
        self.row_start = torch.zeros(2 * max_bs, dtype=torch.int64, device=dev)  # [rows, kv_len before], the prologue's
        # sampled steps: per request temperature, greedy (0/1), top-p, min-p; seed, output-index offset, top-k
        self.floats = torch.ones(4, max_bs, dtype=torch.float32, device=dev)
        self.ints = torch.zeros(3, max_bs, dtype=torch.int64, device=dev)
        # `keep_rows`'s index_selects load their CUDA modules now (a kernel's first launch
        # does; small and large sizes take different kernels), not on a fresh engine's
        # first shrinking batch mid-traffic. Each keeps its rows in place.
        for size in (1, max_bs):
            self.keep_rows(size, torch.arange(size, device=dev))
        # the verify's int32 prefix lengths, written by the prologue kernel (verify_prologue.py)
        self._prefix32 = self._prefix_buffers(runner, max_bs) if capture else {}
        keys = [(b, sampled) for b in self.sizes for sampled in (False, True)]
        with torch.inference_mode():
            self.graphs, self.walks = capture_each(keys, lambda key: self._step(*key), dev) if capture else ({}, {})

    def _prefix_buffers(self, runner: ModelRunner, max_bs: int) -> dict[int, torch.Tensor]:
        """N -> the backend's int32 prefix buffer of verify graphs with N nodes, where it
        has one that holds max_bs requests."""
        get = getattr(runner.attn_backend, "verify_prefix_buffer", None)
        found = {t.n: get(t.n) for t in self._trees} if get is not None else {}
        return {n: buf for n, buf in found.items() if buf is not None and buf.numel() >= max_bs}

    def _trees_for(self, bsz: int) -> _Trees:
        """The tree shape a batch of `bsz` drafts: by the size it replays (batch_tree.py)."""
        batch = len(self._trees) > 1 and self.size_for(bsz) >= self.proposer.batch_from
        return self._trees[1] if batch else self._trees[0]

    def nodes(self, bsz: int) -> int:
        """N, the tree nodes a step over `bsz` requests verifies per request."""
        return self._trees_for(bsz).n

    def can_run(self, bsz: int) -> bool:
        return bsz <= self.max_bs

    def size_for(self, bsz: int) -> int:
        """The captured size a batch of `bsz` replays (padded up to)."""
        return self.sizes[bisect.bisect_left(self.sizes, bsz)]

    @torch.inference_mode()
    def launch(self, reqs: list[Req], slots: torch.Tensor, first: Drafts | None) -> torch.Tensor:
        """Queue one step over `reqs` with their verify `slots` [B*N] (host, N =
        `nodes(B)`). `first`: the trees to verify when the step starts a run (the host's
        kv_len and sampling params are then written too); None continues from the last
        replay's state, which drafted the same tree shape. Returns the walk's packed rows
        [B, 2N + 1] on the device, valid until the next launch. The proposer is handed the
        new trees (`EagleProposer.adopt_ahead`)."""
        b, trees = len(reqs), self._trees_for(len(reqs))
        g, n = self.size_for(b), trees.n
        assert first is not None or trees is self._last, "a run keeps one tree shape"
        self._last = trees
        pad = g - b  # padding requests: the pad row, slot 0
        host = torch.cat([torch.tensor([r.row for r in reqs] + [self.pad_row] * pad, dtype=torch.int64),
                          slots, torch.zeros(pad * n, dtype=torch.int64)])
        self.io[:g * (n + 1)].copy_(host, non_blocking=True)  # pageable: staged before the call returns
        if first is not None:
            self._start_run(reqs, first, trees)
        sampled = not all(r.params.greedy for r in reqs)
        if not self.capture:
            walks = self._step(g, sampled)
        else:
            self.graphs[(g, sampled)].replay()
            walks = self.walks[(g, sampled)]
        self.proposer.adopt_ahead(reqs, self.trees(b))
        return walks[:b]

    def _start_run(self, reqs: list[Req], drafts: Drafts, trees: _Trees) -> None:
        """The state a run's first replay starts from: kv_lens, sampling params, trees."""
        b = len(reqs)
        ps = [r.params for r in reqs]
        vocab = self.runner.vocab_size
        ints = [[r.seed for r in reqs], [r.kv_len - len(r.output_ids) for r in reqs],
                [p.top_k if p.top_k and p.top_k > 0 else vocab for p in ps]]
        self.ints[:, :b].copy_(torch.tensor(ints, dtype=torch.int64), non_blocking=True)
        floats = [[p.temperature for p in ps], [float(p.greedy) for p in ps], [p.top_p for p in ps],
                  [p.min_p for p in ps]]
        self.floats[:, :b].copy_(torch.tensor(floats, dtype=torch.float32), non_blocking=True)
        self.kv_len[:b].copy_(torch.tensor([r.kv_len for r in reqs], dtype=torch.int64), non_blocking=True)
        for static, value in ((trees.tokens, drafts.tokens), (trees.parents, drafts.parents),
                              (trees.mask, drafts.tree_mask())):
            if static.data_ptr() != value.data_ptr():  # the trees a replay left are in place
                static[:b].copy_(value)

    def keep_rows(self, b: int, rows: torch.Tensor) -> None:
        """The next replay continues over rows `rows` [B'] (device) of the last replay of
        size b, whose other requests ended: their state moves to the buffers' front."""
        k, t = rows.numel(), self._last
        for buf in (self.kv_len, t.tokens, t.parents, t.mask):
            buf[:k].copy_(buf[:b].index_select(0, rows))
        for buf in (self.floats, self.ints):  # sampling params, [4 | 3, max_bs]
            buf[:, :k].copy_(buf[:, :b].index_select(1, rows))

    def trees(self, b: int) -> Drafts:
        """The trees the last replay of size b drafted (views of the static buffers)."""
        return self._last.drafts(b)

    def kv_after(self, b: int) -> torch.Tensor:
        """[B] kv_len after the last replay's commit (a view, rewritten by the next launch)."""
        return self.kv_len[:b]

    def _sampling(self, b: int, kv_len: torch.Tensor) -> SamplingBatch:
        """The sampled requests' params with output indices from kv_len."""
        temperature, greedy, top_p, min_p = self.floats[:, :b]
        seeds, offset, top_k = self.ints[:, :b]
        return SamplingBatch(temperature=temperature, greedy=greedy > 0, top_p=top_p, top_k=top_k, min_p=min_p,
                             seeds=seeds, counters=kv_len - offset, flags=_FILTERED)

    def _step(self, b: int, sampled: bool) -> torch.Tensor:
        """The step's device work for b requests, padding included (captured, or eager on a
        CPU); `sampled`: walk the Gumbel targets of seeded sampling rather than the argmax."""
        t, table = self._trees_for(b), self.kv.table
        n, k = t.n, t.drafter.topk
        rows, slots, kv_len = self.io[:b], self.io[b:b * (n + 1)], self.kv_len[:b]
        drafts = t.drafts(b)
        prefix32 = self._prefix32.get(n)
        prefix32 = prefix32[:b] if prefix32 is not None else None
        # a padding request starts at position 0 and output index 0; the table block; positions
        row_start = self.row_start[:2 * b]
        positions = verify_prologue(rows, kv_len, self.ints[1, :b], slots.view(b, n), drafts.tree_mask(), table,
                                    self.pad_row, prefix32, row_start)
        fb = self.runner.device_verify_batch(drafts.tokens.reshape(-1), positions, slots, rows,
                                             prefix32 if prefix32 is not None else kv_len, drafts.tree_mask(),
                                             table.table)
        # a greedy walk only argmaxes the logits: in the model's dtype (llama.py compute_logits)
        logits, features = self.runner.forward_inline(fb, static_meta=self.capture, argmax_only=not sampled)
        assert features is not None, "EAGLE has the runner capture features"
        logits = logits.view(b, n, -1)
        packed, walk = walk_greedy(drafts, logits, None, self._sampling(b, kv_len) if sampled else None)
        # row_start holds kv_len before the commit; kv_len and the trees, read above by the
        # verify and the walk, are the next replay's from here on (written in place)
        self.proposer.draft_ahead_inline(walk, features.view(b, n, -1), slots.view(b, n), row_start,
                                         t.scratch[:, :b * k], t.drafter, kv_len,
                                         (t.tokens[:b], t.parents[:b], t.mask[:b]))
        return packed
