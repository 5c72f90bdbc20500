"""SpecWorker: one speculative decode step = propose -> verify -> accept -> commit.

Before each decode step the scheduler asks `choose(reqs)`; when it says speculate, the
scheduler calls `step(reqs)` and otherwise knows nothing about speculation. Requests with
logits processors (penalties, logit bias, a grammar) keep their drafts: the verify's
logits are processed per node along each node's own path (runner/logits_process.py)
before acceptance, so acceptance is exact for the processed distribution. When the
governor turns speculation down, the step is the scheduler's own plain decode step
(overlapped on CUDA), and the proposer only hears of the new tokens (`on_plain_step` ->
`on_decoded`, before their read-back). On CUDA a greedy EAGLE step is left in flight and
read back after the next one is launched (pipeline.py); `step` then commits the previous
step's tokens. At batch 1-64 such a step is one graph replay (step_graphs.py), which also
pipelines seeded sampling (temperature, top-k, top-p, min-p).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from specserve.core.config import SpecConfig
from specserve.core.h2d import h2d, h2d_many
from specserve.core.messages import TokenLogprob
from specserve.core.request import Req
from specserve.engine.kv_manager import KVManager
from specserve.engine.output import commit_run, commit_token
from specserve.engine.speculation import Decoded
from specserve.runner.logits_process import TreePaths, process
from specserve.runner.model_runner import ModelRunner
from specserve.runner.sampler import sampling_batch, uniform_noise
from specserve.spec import pipeline
from specserve.spec.accept import AcceptResult, accept, accept_greedy_later, gumbel_targets, read_later
from specserve.spec.governor import WARM_STEPS, make_governor
from specserve.spec.pipeline import InFlightSpec
from specserve.spec.proposer import DraftsAhead, Proposer, Verified, WholeStep
from specserve.spec.stats import SpecStats, record_request
from specserve.spec.verify import commit_kv, decode_batch, pad_rows, verify_batch

SPEC_NOISE_SALT = 1 << 40  # keeps the coin walk's uniforms apart from plain sampling noise


class SpecWorker:
    def __init__(self, spec: SpecConfig, runner: ModelRunner, kv: KVManager, proposer: Proposer,
                 eos_ids: frozenset[int], context_length: int, force_greedy_verify: bool = False) -> None:
        """`force_greedy_verify`: accept greedily whatever the sampling params (the
        algorithm's SPECSERVE_NGRAM_FORCE_GREEDY_VERIFY, resolved by the registry)."""
        self.spec, self.runner, self.kv, self.proposer = spec, runner, kv, proposer
        # pipelined drafting on the device, when the proposer has it (proposer.py)
        self.ahead: DraftsAhead | None = proposer if isinstance(proposer, DraftsAhead) else None
        self.force_greedy_verify = force_greedy_verify
        self.eos_ids, self.context_length = eos_ids, context_length
        self.stats = SpecStats()
        self.governor = make_governor(spec.adaptive != "off")  # auto: on, on every device
        self._open: _OpenStep | None = None  # the last step, recorded when the next one starts
        self._start = 0.0  # when the step `choose` was asked about started
        self._last_mode: bool | None = None  # the mode of the last decode step
        self._run = 0  # decode steps in that mode since it was last chosen
        self._switched = False  # the step `choose` was asked about is one of its mode's first
        self._drained = 0  # tokens a drain landed since the last step was opened (see `drain`)
        # Leave greedy EAGLE steps in flight (pipeline.py); the scheduler sets it on CUDA
        # once the verify graphs exist (tests force it on the CPU)
        self.pipeline = False
        self._inflight: InFlightSpec | None = None
        self.step_graphs: WholeStep | None = None  # whole pipelined steps as one graph (eagle/step_graphs.py)

    @property
    def num_draft_tokens(self) -> int:
        return self.proposer.max_nodes

    def admit(self, req: Req) -> None:
        """`req` decodes from now on: the proposer starts tracking it."""
        self.proposer.add_request(req)

    def release(self, req: Req) -> int | None:
        """`req` leaves (finished, aborted or retracted); how much of its KV the prefix
        cache may keep (None: all)."""
        cacheable = self.proposer.cacheable(req)
        self.proposer.remove_request(req)
        return cacheable

    def budgets(self, reqs: list[Req]) -> list[int]:
        return [self.proposer.max_nodes] * len(reqs)

    def slots_needed(self, reqs: list[Req]) -> int:
        """Free slots one step over `reqs` takes at its peak: verify slots plus the
        proposer's scratch (tree drafting), which is freed before verify."""
        return sum(self.budgets(reqs)) + self.proposer.scratch_per_req * len(reqs)

    def on_extend(self, batch, features: torch.Tensor | None) -> None:
        """A target prefill chunk ran (and was sampled): let the proposer see it."""
        if self._open is not None:  # the prefill sits between the last decode step and the next:
            self.governor.unmeasured(self._open.bs, self._open.speculated)  # that step goes unmeasured
            self._open = None
        self._drained = 0  # so do tokens drained before it
        self.proposer.on_extend(batch, features)

    def choose(self, reqs: list[Req]) -> bool:
        """Whether the next decode step over `reqs` speculates (the governor's call, at batch
        1 on the proposer's word where it has one: `drafts_pay`); the scheduler runs the
        step, speculative (`step`) or plain (then `on_plain_step`).

        Only at batch 1, where one request's draft is the whole step's value: an answer
        costs the proposer's upkeep on every plain step (NGRAM indexes each request's new
        tokens, which plain steps otherwise leave for later), which grows with the batch
        while one request's match says less and less of the step (docs/benchmarks.md). The
        price (`on_price`, which NGRAM's gate also drafts by) is given at batch 1 only, too;
        above it, None: every match drafts."""
        bs = len(reqs)
        self.proposer.on_price(self.governor.cost_ratio(bs) if bs == 1 else None)
        hint = self.proposer.drafts_pay(reqs) if bs == 1 else None
        speculate = self.governor.speculate(bs, hint)
        drain = self._open is not None and self._open.speculated != speculate
        # The last step is closed before the drain below: its time is what a step of its
        # mode costs in a run of them. The drain (a pipelined step's whole next step) is no
        # part of that cost; charged to it, it would halve speculation's first rate at
        # batch 1 and hold a fresh engine on plain steps until its first probe
        self._close_last_step(self.governor.clock())
        if drain:
            self._drain()
        self._start = self.governor.clock()
        self._run = self._run + 1 if self._last_mode == speculate else 1
        self._switched = self._run <= WARM_STEPS  # not yet a run's steady pace (governor.py)
        self._last_mode = speculate
        return speculate

    def step(self, reqs: list[Req]) -> list[Req]:
        """One speculative step over every request (`choose` said so; the caller checked
        slots_needed(reqs) are free and drained a step in flight unless `continues(reqs)`).
        Returns the requests whose tokens were committed: `reqs`, or with pipelining those
        of the step that was in flight (none for the first)."""
        if self._pipelines(reqs):
            prev, self._inflight = self._inflight, None
            self._inflight = self._launch(reqs, prev)
            landed, tokens = self._land(prev) if prev is not None else ([], 0)
            drafted = True
        else:
            assert self._inflight is None, "drain the step in flight first"
            landed = reqs
            tokens, drafted = self._speculative_step(reqs)
        tokens, self._drained = tokens + self._drained, 0
        self._open = _OpenStep(len(reqs), True, tokens, self._start, self._switched, drafted)
        return landed

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    def continues(self, reqs: list[Req]) -> bool:
        """Whether a speculative step over `reqs` may launch with no drain first."""
        return self._inflight is None or self._pipelines(reqs)

    def holds(self, req: Req) -> bool:
        """Whether the step in flight carries `req` (an abort drains it first)."""
        return self._inflight is not None and any(r is req for r in self._inflight.reqs)

    def drain(self) -> list[Req]:
        """Read back and commit the step in flight, if any; returns its requests.

        Its tokens go to the governor with the next speculative step, as a pipelined step's
        tokens go with the step after it. A batch that changes (a request ends) drains the
        pipeline and launches a first step that lands nothing: left out, the drain's tokens
        and that step's time (the read-back wait, a launch with nothing to overlap) made the
        samples those of unbroken pipelines only, the cheapest steps at a large batch."""
        done, self._inflight = self._inflight, None
        if done is None:
            return []
        landed, tokens = self._land(done)
        self._drained += tokens
        return landed

    def _pipelines(self, reqs: list[Req]) -> bool:
        """Whether a step over `reqs` is launched and left in flight (pipeline.py): after
        the one in flight when it ran over the same requests and drafted their trees."""
        # sampled walks run on the device in the step graphs alone, and only when exact (thresholds 1)
        sampled = self.step_graphs is not None and self.step_graphs.can_run(len(reqs)) \
            and self.spec.accept_threshold_single >= 1.0 and self.spec.accept_threshold_acc >= 1.0
        ahead = self.ahead
        if not self.pipeline or ahead is None or not ahead.can_draft_ahead(len(reqs)) \
                or not pipeline.eligible(reqs, self._depth, self.context_length, sampled):
            return False
        prev = self._inflight
        # a run keeps its tree shape: a batch that shrinks across batch_from drains (batch_tree.py)
        return prev is None or (prev.live_rows(reqs) is not None and prev.graphed == self._graphed(len(reqs))
                                and prev.nodes == self._nodes(len(reqs)) and ahead.has_drafted_ahead(prev.reqs))

    @property
    def _depth(self) -> int:
        """A bound on a step's tree depth: N - 1, a chain's (NGRAM's on the device; EAGLE's
        trees reach num_steps <= N - 1)."""
        return self.proposer.max_nodes - 1

    def _graphed(self, bsz: int) -> bool:
        """Whether a pipelined step over `bsz` requests is one step-graph replay."""
        return self.step_graphs is not None and self.step_graphs.can_run(bsz)

    def _nodes(self, bsz: int) -> int:
        """N of a pipelined step over `bsz` requests: its step graph's tree (the batch tree
        from batch_from requests, batch_tree.py), else the main tree's."""
        g = self.step_graphs
        return g.nodes(bsz) if g is not None and g.can_run(bsz) else self.proposer.max_nodes

    def capture_graphs(self, max_bs: int) -> None:
        """Capture graphs of the whole pipelined step for batches up to `max_bs`, when
        pipelining is on and the proposer can draft inside them."""
        if self.pipeline and self.ahead is not None:
            self.step_graphs = self.ahead.whole_step(self.runner, self.kv, max_bs)

    def _launch(self, reqs: list[Req], prev: InFlightSpec | None) -> InFlightSpec:
        """Queue a greedy step over full trees from the device state `prev` left (or the
        host's, when nothing is in flight) and its draft-ahead; read nothing back. `prev`
        may carry requests that ended (dropped): the step takes the rows of the others."""
        b, n, dev, ahead_drafter = len(reqs), self._nodes(len(reqs)), self.runner.device, self.ahead
        assert ahead_drafter is not None, "_pipelines checked it"
        slots = self.kv.alloc_each([n] * b)
        assert slots is not None, "the scheduler made room (slots_needed)"
        live = prev.live_rows(reqs) if prev is not None and prev.dropped else None
        keep = h2d(live, dev) if live is not None else None  # [B] rows of `prev` (device)
        if self._graphed(b):
            return self._launch_graphed(reqs, prev, slots, keep)
        rows, flat = h2d_many([[r.row for r in reqs], torch.cat(slots)], dev)
        if prev is None:
            starts = h2d([r.kv_len for r in reqs], dev)
        elif keep is None:
            starts = prev.kv_after
        else:
            assert live is not None
            starts = prev.kv_after.index_select(0, keep)
            ahead_drafter.keep_ahead(reqs, live, keep)
        self.kv.table.write_block(rows, starts, flat.view(b, n))
        drafts = self.proposer.propose(reqs, [n] * b)  # after `prev`: its trees, drafted ahead
        positions = (starts[:, None] + drafts.depths()).reshape(-1)
        fb = self.runner.device_verify_batch(drafts.tokens.reshape(-1), positions, flat, rows, starts,
                                             drafts.tree_mask(), self.kv.table.table)
        logits, features = self.runner.forward_with_features(fb)
        feats = features.view(b, n, -1) if features is not None else None  # a draft LLM reads none
        ahead = _DraftAhead(ahead_drafter, reqs, feats, fb.out_slots.view(b, n), True, torch.cat([rows, starts]))
        pending = accept_greedy_later(drafts, logits.view(b, n, -1), ahead)
        assert ahead.kv_after is not None, "a greedy walk runs the hook before its read-back"
        return InFlightSpec(reqs, slots, pending, ahead.kv_after)

    def _launch_graphed(self, reqs: list[Req], prev: InFlightSpec | None, slots: list[torch.Tensor],
                        keep: torch.Tensor | None) -> InFlightSpec:
        """_launch as one replay of the step graph: `prev` left its kv_len and trees in the
        graph's buffers (rows `keep` of them when some of its requests ended); a first
        step brings the host's."""
        g = self.step_graphs
        assert g is not None, "_graphed checked it"
        b, n = len(reqs), g.nodes(len(reqs))
        first = self.proposer.propose(reqs, [n] * b) if prev is None else None
        if keep is not None:
            assert prev is not None, "rows are kept from the step in flight"
            g.keep_rows(len(prev.reqs), keep)
        packed = g.launch(reqs, torch.cat(slots), first)  # hands the proposer its next trees
        return InFlightSpec(reqs, slots, read_later(packed), g.kv_after(b), graphed=True)

    def _land(self, done: InFlightSpec) -> tuple[list[Req], int]:
        """Commit a step launched by `_launch` (the table holds its slots already); requests
        it ends give back their place in the step now in flight. (requests, tokens)."""
        result = done.pending.result()
        live = [i for i in range(len(done.reqs)) if i not in done.dropped]
        reqs, paths = [done.reqs[i] for i in live], [result.paths[i] for i in live]
        committed = []
        for i, req in zip(live, reqs):
            committed.append(self._commit_tokens(req, result.tokens[i], result.paths[i], None))
            self._record(req, len(committed[-1]), drafted=True, nodes=done.nodes)
        kept = commit_kv(self.kv, reqs, [done.slots[i] for i in live], paths, [len(c) for c in committed],
                         write_table=False)
        self.proposer.on_verified(reqs, Verified(committed, paths, None, kept, extended=True))
        cur = self._inflight
        if cur is not None:
            for i, req in enumerate(cur.reqs):
                if req.finished and i not in cur.dropped:
                    cur.drop(i, self.kv)
            if cur.all_dropped:
                self._inflight = None  # nothing in it will be read
        return reqs, sum(map(len, committed))

    def on_plain_step(self, reqs: list[Req], decoded: Decoded) -> None:
        """The scheduler ran a plain decode step (`choose` said so), its tokens still on the
        device: the proposer hears of them (EAGLE keeps the step's features and tokens on
        the device, and extends its draft over a whole plain run when speculation resumes)."""
        self.proposer.on_decoded(reqs, decoded)
        self._drained = 0  # speculative tokens are no sample of a plain step
        for req in reqs:
            self._record(req, 1, drafted=False)
        self._open = _OpenStep(len(reqs), False, len(reqs), self._start, self._switched, True)

    def _drain(self) -> None:
        """At a mode switch: GPU work a step queued after its read-back (EAGLE's draft
        extend; an overlapped plain step) would run into the next step; drain it so it is
        charged to neither mode (the switch step after it is no sample either)."""
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    def _close_last_step(self, now: float) -> None:
        """A step's cost, for the governor, is the time from its start to the next step's
        start: its forward and read-back, and the engine's work on its outputs (per token,
        so it weighs more on plain steps than the step alone shows)."""
        step = self._open
        if step is not None:
            self.governor.record(step.bs, step.speculated, step.tokens, now - step.start, switched=step.switched,
                                 drafted=step.drafted)
        self._open = None

    def _speculative_step(self, reqs: list[Req]) -> tuple[int, bool]:
        """Propose, verify, accept, commit. Returns (tokens committed, whether any request
        had a draft: a step without one ran as a decode)."""
        budgets = self.budgets(reqs)
        slots = self.kv.alloc_each(budgets)
        assert slots is not None, "the scheduler made room (slots_needed)"
        self.kv.table.write_many([r.row for r in reqs], [r.kv_len for r in reqs], slots)
        drafts = self.proposer.propose(reqs, budgets)
        if drafts.num_nodes == 1:  # nothing drafted: the verify is a decode (DECODE graphs)
            batch = decode_batch(reqs, drafts, slots)
        else:
            if self.runner.verify_graph_tokens == self.proposer.max_nodes:  # verify runs as a captured graph
                drafts = drafts.padded(self.proposer.max_nodes)
            batch = verify_batch(reqs, drafts, slots, full=drafts.num_nodes == self.proposer.max_nodes)
        fb = self.runner.forward_batch(batch, self.kv.table.table)
        logits, features = self.runner.forward_with_features(fb)
        logits = pad_rows(logits, batch.extend_lens, drafts.num_nodes)
        if features is not None:
            features = pad_rows(features, batch.extend_lens, drafts.num_nodes)
        ahead = self._ahead(reqs, drafts, features, fb, budgets)
        committed, paths, kept = self._accept_and_commit(reqs, drafts, logits, slots, [n > 1 for n in budgets],
                                                         ahead)
        extended = ahead is not None and ahead.ran
        self.proposer.on_verified(reqs, Verified(committed, paths, features, kept, extended=extended))
        return sum(map(len, committed)), drafts.num_nodes > 1

    def _ahead(self, reqs: list[Req], drafts, features: torch.Tensor | None, fb,
               budgets: list[int]) -> _DraftAhead | None:
        """The accept hook that lets the proposer draft ahead (eagle.py), when it can: full
        trees for every request (their slots and features are [B, N] views) and the
        proposer's graphs."""
        n = drafts.num_nodes
        full = n == self.proposer.max_nodes and min(budgets) >= n and fb.out_slots.numel() == len(reqs) * n
        if features is None or not full or self.ahead is None or not self.ahead.can_draft_ahead(len(reqs)):
            return None
        trees = self.governor.leaning(len(reqs))  # trees for a step the governor will likely speculate
        row_start = h2d([r.row for r in reqs] + [r.kv_len for r in reqs], fb.out_slots.device)
        return _DraftAhead(self.ahead, reqs, features, fb.out_slots.view(len(reqs), n), trees, row_start)

    def _accept_and_commit(self, reqs: list[Req], drafts, logits: torch.Tensor, slots: list[torch.Tensor],
                           drafted: list[bool], ahead: _DraftAhead | None = None
                           ) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        """drafted[b]: request b was given a draft budget; `ahead` from `_ahead` (its hook
        runs only where acceptance walks on the device)."""
        sb = sampling_batch(reqs, self.runner.vocab_size, logits.device)
        if any(r.params.processed for r in reqs):
            tree = TreePaths.of(drafts.tokens, drafts.parents, drafts.valid, drafts.tree_mask())
            logits = process(logits, reqs, tree)
        result = self._accept(drafts, logits, sb, ahead)
        committed = []
        for b, req in enumerate(reqs):
            done = self._commit_tokens(req, result.tokens[b], result.paths[b], logits[b])
            committed.append(done)
            self._record(req, len(done), drafted[b])
        ran = ahead is not None and ahead.ran  # then the table already holds the committed slots
        kept = commit_kv(self.kv, reqs, slots, result.paths, [len(c) for c in committed], write_table=not ran,
                         in_node_order=True)
        return committed, result.paths, kept

    def _accept(self, drafts, logits: torch.Tensor, sb, before_read=None) -> AcceptResult:
        """Exact Gumbel verification by default; SGLang's coin walk when thresholds relax it.

        At thresholds 1.0 both are lossless, but the Gumbel form also reproduces seeded
        plain sampling token for token (the coin walk's draws depend on the draft tree).
        `before_read` goes to `accept` on the greedy walks (the coin walk reads back first).
        """
        force_greedy = self.force_greedy_verify
        relaxed = self.spec.accept_threshold_single < 1.0 or self.spec.accept_threshold_acc < 1.0
        unused = torch.zeros(drafts.batch_size, drafts.num_nodes + 1)  # greedy walks draw nothing
        if sb.all_greedy or force_greedy:
            return accept(drafts, logits, sb, unused[:, :-1], unused[:, -1], force_greedy=True,
                          before_read=before_read)
        if not relaxed:
            targets = gumbel_targets(logits, sb, drafts.depths())
            return accept(drafts, targets, sb, unused[:, :-1], unused[:, -1], force_greedy=True,
                          before_read=before_read)
        noise = uniform_noise(sb.seeds, sb.counters + SPEC_NOISE_SALT, drafts.num_nodes + 1)
        return accept(drafts, logits, sb, noise[:, :-1], noise[:, -1], self.spec.accept_threshold_single,
                      self.spec.accept_threshold_acc, force_greedy=force_greedy)

    def _commit_tokens(self, req: Req, tokens: list[int], path: list[int], logits: torch.Tensor | None) -> list[int]:
        """Commit an accepted run up to where it ends the request; `logits` [N, V] the
        verify's (None when no request asked for logprobs)."""
        if not req.params.logprobs:
            return tokens[:commit_run(req, tokens, self.eos_ids, self.context_length)]
        assert logits is not None, "the verify's logits are kept when a request asks for logprobs"
        done = []
        for i, tok in enumerate(tokens):
            commit_token(req, tok, self.eos_ids, self.context_length, _logprob_entry(req, tok, logits[path[i]]))
            done.append(tok)
            if req.finished:  # EOS / stop string / max_tokens inside the accepted run
                break
        return done

    def _record(self, req: Req, committed: int, drafted: bool, nodes: int | None = None) -> None:
        """The step's counters (stats.py); `nodes`: the verified tree's N (default the main tree's)."""
        record_request(req.meta, committed, drafted, nodes or self.proposer.max_nodes)
        if drafted:
            self.stats.add(1, committed)


class _OpenStep(NamedTuple):
    """A decode step, recorded with the governor when the next one starts (`_close_last_step`)."""

    bs: int
    speculated: bool  # the mode `choose` picked
    tokens: int
    start: float
    switched: bool  # one of the first WARM_STEPS of its mode
    drafted: bool  # a speculative step verified some draft (without one it ran as a decode); plain: True


class _DraftAhead:
    """`accept`'s before-read hook: the proposer's draft_ahead over this step's requests,
    features [B, N, F] (None: a draft LLM's, which reads none) and slots [B, N],
    row_start [2B] their table rows then kv_lens (on the device); `ran` once it was called
    (greedy walks only), `kv_after` [B] the kv_lens it left."""

    def __init__(self, proposer: DraftsAhead, reqs: list[Req], features: torch.Tensor | None, slots: torch.Tensor,
                 trees: bool, row_start: torch.Tensor) -> None:
        self.proposer, self.reqs, self.features, self.slots, self.trees = proposer, reqs, features, slots, trees
        self.row_start = row_start
        self.ran = False
        self.kv_after: torch.Tensor | None = None

    def __call__(self, walk) -> None:
        self.kv_after = self.proposer.draft_ahead(self.reqs, walk, self.features, self.slots, self.trees,
                                                  self.row_start)
        self.ran = True


def _logprob_entry(req: Req, token: int, row: torch.Tensor) -> TokenLogprob:
    logp = row.log_softmax(-1)
    k = req.params.top_logprobs
    top = []
    if k:
        vals, ids = logp.topk(k)
        top = list(zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(token, float(logp[token]), top)
