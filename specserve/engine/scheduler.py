"""The scheduler: continuous batching over one ModelRunner.

One `step()` = pick a batch, run it, process its tokens:
  * prefill first: continue chunked prefills, then admit waiting requests while the
    chunk budget, the running-request cap, table rows and KV memory allow;
  * otherwise decode every running request one token, retracting the newest requests
    (their KV handed to the prefix cache, themselves requeued at the front) when memory
    runs out, so nothing is lost and nothing crashes.
It knows requests, memory and policy; not HTTP, not processes, not the model's insides.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import asdict

import torch

from specserve.core import parallel
from specserve.core.batch import ScheduleBatch
from specserve.core.forward_batch import ForwardBatch, ForwardMode
from specserve.core.messages import GenerateReq, TokenOut
from specserve.core.request import Req
from specserve.engine.kv_manager import KVManager
from specserve.engine.metrics import SchedulerStats
from specserve.engine.output import commit_sampled, finish_abort, take_output
from specserve.engine.overlap import InFlight, decode_inputs, select, surely_ends
from specserve.engine.protocol import EngineStart
from specserve.engine.speculation import Decoded, SpecNeeds, Speculator
from specserve.grammar.compiler import GrammarCompiler
from specserve.grammar.queue import GrammarQueue
from specserve.models import quantization
from specserve.runner.logits_process import process_rows
from specserve.runner.memory import OOM_ADVICE
from specserve.runner.model_runner import ModelRunner
from specserve.runner.sampler import SampleOutput
from specserve.tokenizer.streaming import IncrementalDetokenizer, StopChecker
from specserve.tokenizer.tokenizer import Tokenizer

DECODE_RESERVE_CLIP = 256  # future tokens per request counted when admitting new work
DECODE_RESERVE_RATIO = 0.3


class Scheduler:
    def __init__(self, start: EngineStart, tokenizer: Tokenizer) -> None:
        self.cfg = cfg = start.config
        self.tokenizer = tokenizer
        try:
            self._build_device_state(start, tokenizer)
        except torch.cuda.OutOfMemoryError as e:
            raise RuntimeError(f"{OOM_ADVICE} ({str(e).splitlines()[0]})") from None
        self.rng = random.Random(cfg.scheduler.random_seed)
        self.waiting: deque[Req] = deque()
        # constrained requests wait here for their grammar matcher (built off this thread,
        # except under TP, where every rank must admit them in the same step)
        self.grammars = GrammarQueue(lambda: GrammarCompiler(tokenizer.to_json(), self.runner.vocab_size,
                                                             sorted(self.eos_ids)), sync=parallel.tp_size() > 1)
        self.prefilling: list[Req] = []
        self.running: list[Req] = []
        self.stats = SchedulerStats()
        self._inflight: InFlight | None = None
        # --num-continuous-decode-steps: decode steps still owed before the next look for
        # prefills (0: look at this step). Batching admissions saves the prefill steps that
        # would otherwise cut in whenever one request of a large batch ends.
        self.continuous_decode_steps = max(1, cfg.scheduler.num_continuous_decode_steps)
        self._decodes_owed = 0

    def _build_device_state(self, start: EngineStart, tokenizer: Tokenizer) -> None:
        """Model, KV memory, speculative worker and CUDA graphs: everything that allocates on the device."""
        cfg, needs = start.config, start.spec.needs if start.spec is not None else SpecNeeds()
        self.runner = ModelRunner(start.model_dir, cfg.model, cfg.cache, cfg.runner,
                                  chunked_prefill_size=cfg.scheduler.chunked_prefill_size,
                                  draft_headroom_mb=needs.draft_headroom_mb, draft_kv_shape=needs.draft_kv_shape)
        self.context_length = self.runner.context_length
        sc = cfg.scheduler
        self.max_running = sc.max_running_requests or (256 if self.runner.device.type == "cuda" else 128)
        chunk = sc.chunked_prefill_size or (4096 if self.runner.device.type == "cuda" else 1024)
        self.chunk_budget = chunk if chunk > 0 else sc.max_prefill_tokens
        self.chunking = chunk > 0
        tree_room = needs.verify_tokens + 8  # a verify writes N slots past kv_len
        rows = self.max_running + 8
        self.kv = KVManager(self.runner.num_slots, rows, self.context_length + tree_room,
                            self.runner.device, not cfg.cache.disable_radix_cache,
                            prefix_backoff=needs.prefix_backoff)
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self.spec: Speculator | None = None
        if start.spec is not None:
            self.spec = start.spec.build(self.runner, self.kv, self.eos_ids, self.context_length, self.max_running)
        self.runner.warm_up_kernels(self.kv.table.table)
        self.runner.capture_cuda_graphs(self.kv.table.table, self.max_running,
                                        self.spec.num_draft_tokens if self.spec is not None else 0)
        # Overlap plain decode steps on CUDA (on a CPU the host is the device: nothing to overlap)
        self.overlap = self.runner.device.type == "cuda" and not cfg.scheduler.disable_overlap_schedule
        if self.spec is not None:  # pipelined speculative steps run through the verify graphs
            self.spec.pipeline = self.overlap and self.runner.verify_graph_tokens == self.spec.num_draft_tokens
            self.spec.capture_graphs(self.runner.graph_max_bs(self.max_running))

    # -- requests in and out ------------------------------------------------------------
    def add_request(self, g: GenerateReq) -> list[TokenOut]:
        p = g.params
        req = Req(g.rid, g.input_ids, p, p.seed if p.seed is not None else self.rng.getrandbits(63),
                  IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens), StopChecker(p.stop))
        self.stats.requests_total += 1
        error = self._check_request(req)
        if error:
            finish_abort(req, error)
            return [take_output(req)]
        if req.max_new_tokens == 0:
            req.finish_reason = {"type": "length"}
            return [take_output(req)]
        if p.constraint is not None:
            self.grammars.submit(req)
            return self._take_grammars()
        self.waiting.append(req)
        return []

    def _take_grammars(self) -> list[TokenOut]:
        """Constrained requests whose matcher is built join the waiting queue; those whose
        grammar failed to build end with its error."""
        outs = []
        for req, error in self.grammars.ready():
            if error is None:
                self.waiting.append(req)
            else:
                finish_abort(req, error)
                outs.append(take_output(req))
        return outs

    def _check_request(self, req: Req) -> str | None:
        n = len(req.prompt_ids)
        if n == 0:
            return "the prompt is empty"
        if n >= self.context_length:
            return f"the prompt has {n} tokens, the context length is {self.context_length}"
        try:
            req.params.validate(self.runner.vocab_size)
        except ValueError as e:
            return str(e)
        if any(not 0 <= t < self.runner.vocab_size for t in req.prompt_ids):
            return "input_ids contain ids outside the vocabulary"
        return None

    def abort(self, rid: str) -> list[TokenOut]:
        """Abort request `rid`: its output (and those of a speculative step in flight that
        carried it, read back first)."""
        landed = []
        if self.spec is not None and any(r.rid == rid and self.spec.holds(r) for r in self.running):
            landed = self._land_spec()
        return landed + self._abort(rid)

    def _abort(self, rid: str) -> list[TokenOut]:
        pending = self.grammars.remove(rid)
        if pending is not None:
            finish_abort(pending, "aborted")
            self.stats.requests_aborted += 1
            return [take_output(pending)]
        for queue in (self.waiting, self.prefilling, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    self._release(req)
                    finish_abort(req, "aborted")
                    self.stats.requests_aborted += 1
                    if self._inflight is not None and all(r.finished for r in self._inflight.reqs):
                        self._inflight = None  # the step in flight has no live request left
                    return [take_output(req)]
        return []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.grammars.pending)

    # -- one step ---------------------------------------------------------------------
    def step(self) -> list[TokenOut]:
        outs: list[TokenOut] = self._take_grammars() if self.grammars.pending else []
        look = self._decodes_owed == 0 or not self.running
        batch = self._prefill_batch() if look else None  # may run while an overlapped step is in flight
        if batch is None:
            self._decodes_owed = (self._decodes_owed or self.continuous_decode_steps) - 1
            if self.spec is not None and self.running and self.spec.choose(self.running):
                return outs + self._drain() + self._spec_step()
            outs += self._land_spec()
            if self._can_overlap():
                return outs + self._overlapped_decode()
            outs += self._drain()
            batch = self._decode_batch()
            if batch is None:
                return outs
        fb = self.runner.forward_batch(batch, self.kv.table.table)
        logits, features = self.runner.forward_with_features(fb)
        sampled = batch.sampled_reqs
        if sampled:
            logits = process_rows(logits, sampled)
            so = self.runner.sample(logits, sampled)
            if batch.mode == ForwardMode.DECODE:
                self._tell_proposer(sampled, so, fb, features)
            self._commit(sampled, so)
        if self.spec is not None and batch.mode == ForwardMode.EXTEND:
            self.spec.on_extend(batch, features)  # before _collect may release finished requests
        return outs + self._collect(batch)

    # -- overlapped plain decoding (engine/overlap.py) ----------------------------------
    def _can_overlap(self) -> bool:
        """Overlap needs no retraction this step (memory for every running request) and
        no logits processors (penalties count output tokens and a grammar advances over them:
        the in-flight token is not known yet)."""
        return self.overlap and bool(self.running) and self.kv.available() >= len(self.running) \
            and not any(r.params.processed for r in self.running)

    def _overlapped_decode(self) -> list[TokenOut]:
        """Launch a decode step fed from the in-flight step's device ids, then read back
        and commit the in-flight step's tokens while the new one runs."""
        prev = self._inflight
        ahead = prev.index_of() if prev is not None else {}
        reqs = [r for r in self.running if id(r) not in ahead or not surely_ends(r, self.context_length)]
        if not reqs:  # every request ends on the in-flight token: nothing to launch
            return self._drain()
        prefix = [r.kv_len for r in reqs]
        slots = self.kv.extend_each(reqs)
        assert slots is not None, "_can_overlap checked the memory"
        self._log_decode(reqs, len(reqs))
        batch = ScheduleBatch.decode(reqs, slots, prefix, decode_inputs(reqs, prev, ahead, self.runner.device))
        fb = self.runner.forward_batch(batch, self.kv.table.table)
        logits, features = self.runner.forward_with_features(fb)
        lag = [int(id(r) in ahead) for r in reqs]
        so = self.runner.sample(logits, reqs, lag)
        self._tell_proposer(reqs, so, fb, features)
        self._inflight = InFlight.launch(reqs, so, slots)
        return self._read_back(prev) if prev is not None else []

    def _tell_proposer(self, reqs: list[Req], so: SampleOutput, fb: ForwardBatch,
                       features: torch.Tensor | None) -> None:
        """A plain decode step in a speculative engine (the governor's choice): the proposer
        hears of its tokens while they are still on the device."""
        if self.spec is not None:
            self.spec.on_plain_step(reqs, Decoded(so.next_ids, fb.positions, fb.out_slots, fb.req_rows,
                                                  fb.prefix_lens, features))

    def _drain(self) -> list[TokenOut]:
        """Read back and commit the step in flight, if any (before a step that cannot overlap)."""
        prev, self._inflight = self._inflight, None
        return self._read_back(prev) if prev is not None else []

    def _read_back(self, done: InFlight) -> list[TokenOut]:
        """Commit `done`'s tokens; a request they end gives back its position in the step
        now in flight (if it is in it) before it is released."""
        live = [i for i, r in enumerate(done.reqs) if i not in done.dropped and not r.finished]
        reqs = [done.reqs[i] for i in live]
        self._commit(reqs, select(done.wait(), live))
        cur, ended = self._inflight, [r for r in reqs if r.finished]
        if cur is not None and ended:
            ahead = cur.index_of()
            for req in ended:
                if id(req) in ahead:
                    cur.drop(ahead[id(req)], self.kv)
            if cur.all_dropped:
                self._inflight = None  # all of it is garbage: never read it
        return self._finish_and_take(reqs)

    def _commit(self, reqs: list[Req], so: SampleOutput) -> None:
        commit_sampled(reqs, so, self.eos_ids, self.context_length)
        self.stats.generation_tokens_total += len(reqs)

    def _collect(self, batch: ScheduleBatch) -> list[TokenOut]:
        sampled = batch.sampled_reqs
        if batch.mode == ForwardMode.EXTEND:  # prefill complete: these now decode
            done = {id(r) for r in sampled}
            self.prefilling = [r for r in self.prefilling if id(r) not in done]
            self.running += sampled
            if self.spec is not None:
                for req in sampled:
                    self.spec.admit(req)
        return self._finish_and_take(sampled)

    def _finish_and_take(self, reqs: list[Req]) -> list[TokenOut]:
        outs = []
        for req in reqs:
            if req.finished:
                self.running.remove(req)
                self._release(req)
                self.stats.requests_finished += 1
            outs.append(take_output(req))
        return outs

    def _release(self, req: Req) -> None:
        cacheable = self.spec.release(req) if self.spec is not None else None
        self.kv.release(req, cacheable)

    def _spec_step(self) -> list[TokenOut]:
        """Speculative decode of every running request (propose, verify, accept, commit);
        a pipelined step commits the one before it (spec/pipeline.py)."""
        spec, outs = self.spec, []
        assert spec is not None, "choose() said speculate"
        if not spec.continues(self.running) or self.kv.available() < spec.slots_needed(self.running):
            outs = self._land_spec()  # before a retraction, or a step that cannot follow it
        while self.running and self.kv.available() < spec.slots_needed(self.running):
            self._retract(self.running[-1])
        if not self.running:
            return outs
        reqs = list(self.running)
        before = sum(len(r.output_ids) for r in reqs)
        landed = spec.step(reqs)
        new_tokens = sum(len(r.output_ids) for r in reqs) - before
        self.stats.generation_tokens_total += new_tokens
        self._log_decode(reqs, new_tokens)
        return outs + self._finish_and_take(landed)

    def _land_spec(self) -> list[TokenOut]:
        """Read back and commit the speculative step in flight, if any."""
        if self.spec is None or not self.spec.in_flight:
            return []
        reqs = self.spec.drain()
        # each step's output is taken when it lands: what is pending is this one's tokens
        self.stats.generation_tokens_total += sum(len(r.pending_ids) for r in reqs)
        return self._finish_and_take(reqs)

    # -- batch selection --------------------------------------------------------------
    def _decode_reserve(self) -> int:
        reqs = self.running + self.prefilling
        return int(DECODE_RESERVE_RATIO * sum(min(r.remaining_new_tokens, DECODE_RESERVE_CLIP) for r in reqs))

    def _prefill_batch(self) -> ScheduleBatch | None:
        budget = self.chunk_budget
        chosen: list[tuple[Req, int, torch.Tensor]] = []
        for req in self.prefilling:  # chunked prefills in progress go first
            n = min(req.prefill_remaining, budget)
            start = req.kv_len
            slots = self.kv.extend(req, n) if n > 0 else None
            if slots is None:
                break
            chosen.append((req, start, slots))
            budget -= n
        while self.waiting and budget > 0 and self._can_admit():
            req = self.waiting[0]
            if not self.kv.admit(req):
                break
            n = req.prefill_remaining if not self.chunking and not chosen else min(req.prefill_remaining, budget)
            need = n + int(DECODE_RESERVE_RATIO * min(req.remaining_new_tokens, DECODE_RESERVE_CLIP))
            if self.kv.available() - self._decode_reserve() < need and (chosen or self.running):
                self.kv.release(req)
                break
            start = req.kv_len
            slots = self.kv.extend(req, n)
            if slots is None:
                self.kv.release(req)
                break
            self.waiting.popleft()
            self.prefilling.append(req)
            chosen.append((req, start, slots))
            budget -= n
        if not chosen:
            return None
        return self._make_extend(chosen)

    def _can_admit(self) -> bool:
        return len(self.running) + len(self.prefilling) < self.max_running

    def _make_extend(self, chosen: list[tuple[Req, int, torch.Tensor]]) -> ScheduleBatch:
        reqs = [r for r, _, _ in chosen]
        ids, prefix, ext, mask = [], [], [], []
        for req, start, slots in chosen:
            ids += req.all_ids[start:start + slots.numel()]
            prefix.append(start)
            ext.append(slots.numel())
            mask.append(start + slots.numel() == req.seq_len)
        new_tokens = sum(ext)
        cached = sum(r.cached_len for r, s, _ in chosen if s == r.cached_len)
        self.stats.prompt_tokens_total += new_tokens
        self.stats.cached_tokens_total += cached
        self.stats.on_prefill(len(chosen), new_tokens, cached, self.token_usage,
                              len(self.running), len(self.waiting))
        return ScheduleBatch(ForwardMode.EXTEND, reqs, ids, torch.cat([s for _, _, s in chosen]),
                             prefix, ext, mask)

    def _decode_batch(self) -> ScheduleBatch | None:
        while self.running and self.kv.available() < len(self.running):
            self._retract(self.running[-1])
        if not self.running:
            return None
        reqs = list(self.running)
        prefix = [r.kv_len for r in reqs]
        slots = self.kv.extend_each(reqs)
        assert slots is not None, "available() >= len(reqs): cannot fail"
        self._log_decode(reqs, len(reqs))
        return ScheduleBatch.decode(reqs, slots, prefix)

    def _log_decode(self, reqs: list[Req], new_tokens: int) -> None:
        spec = None
        if self.spec is not None and self.stats.decode_steps % self.cfg.scheduler.decode_log_interval == \
                self.cfg.scheduler.decode_log_interval - 1:
            spec = (self.spec.stats.take_window(), self.spec.num_draft_tokens)
        self.stats.on_decode(new_tokens, self.cfg.scheduler.decode_log_interval, len(reqs),
                             self.kv.used(), self.token_usage, len(self.waiting), False, spec)

    def _retract(self, req: Req) -> None:
        """Out of KV memory: free req's slots (cached for later) and requeue it first."""
        self.running.remove(req)
        self._release(req)
        self.waiting.appendleft(req)
        self.stats.retractions_total += 1

    # -- introspection ----------------------------------------------------------------
    @property
    def token_usage(self) -> float:
        return self.kv.used() / self.kv.num_slots

    def flush_cache(self) -> bool:
        if self.has_work:
            return False
        return self.kv.flush_cache()

    def server_info(self) -> dict:
        return {**asdict(self.cfg), "max_total_num_tokens": self.kv.num_slots,
                "context_length": self.context_length, "max_running_requests": self.max_running,
                "device": str(self.runner.device), "dtype": str(self.runner.dtype),
                "kv_cache_dtype": self.cfg.cache.kv_cache_dtype,  # SGLang's key; the pool's dtype below
                "kv_cache_torch_dtype": str(self.runner.kv_dtype),
                "weight_quantization": quantization.info(self.runner.model),
                "internal_states": [{"avg_spec_accept_length": self._avg_accept_length()}]}

    def _avg_accept_length(self) -> float | None:
        return self.spec.stats.avg_accept_length if self.spec is not None else None

    def metrics(self) -> dict:
        s = self.stats
        return {"num_running_reqs": len(self.running) + len(self.prefilling),
                "num_queue_reqs": len(self.waiting), "token_usage": self.token_usage,
                "gen_throughput": s.gen_throughput, "prompt_tokens_total": s.prompt_tokens_total,
                "generation_tokens_total": s.generation_tokens_total,
                "cached_tokens_total": s.cached_tokens_total, "num_requests_total": s.requests_total,
                "num_requests_aborted_total": s.requests_aborted,
                "num_retractions_total": s.retractions_total, **self._spec_metrics()}

    def _spec_metrics(self) -> dict:
        if self.spec is None or self.spec.stats.avg_accept_length is None:
            return {}
        length = self.spec.stats.avg_accept_length
        return {"spec_accept_length": length, "spec_accept_rate": length / self.spec.num_draft_tokens}
