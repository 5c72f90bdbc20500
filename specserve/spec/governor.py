"""Turning speculation down when it does not pay (DESIGN 3.4: never slower than plain).

Speculation pays when accepted tokens per second beat plain decoding's tokens per
second, and both depend on the batch size (a verify of N tokens per request is almost
free at batch 1 and costs ~N decode steps once the GPU is compute-bound) and on the
traffic (how often drafts are accepted). So the governor measures instead of modelling:
per batch-size bucket it keeps each mode's rate (its mean tokens per request over the
mean seconds of its last 8 steps but the slowest), runs the better mode, and probes the
other one so the estimate follows the traffic.

The mean tokens weigh a sample by its age in the bucket's steps, of either mode (an
effective window of 128 steps: at batch 1 a verify commits 1 to 7 tokens, so fewer give a
noisy mean). A mode only probed keeps its samples from before it was turned down, so
without ageing a stretch of text the head drafted badly would stay in its mean for as many
probes as the window holds, and hold the governor on plain decoding long after the text
changed.

Probing is an exploration budget: a probe (three steps of the other mode, the last the
sample: `record`) is due once its expected loss (the time its steps take beyond what the
chosen mode would take for the same tokens, plus what the warm-up steps of both switches,
into the other mode and back, take beyond their modes' steady steps, measured) is at most
EXPLORE_SHARE of the time the bucket ran since its last probe, and never sooner than
`probe_every` steps after it. The warm-ups are priced because they are real (the first
speculative step after plain ones drafts its tree cold); the drain at a switch is left
out: it waits mostly for the step in flight, whose tokens are output. A close call costs
little to probe, so it is probed every `probe_every` steps and its estimate keeps up; a
clearly slower mode is probed rarely, its probes spaced by their expected loss. A probe
step faster than the chosen mode (a change of traffic, or luck at batch 1) makes the next
probe due `probe_every` steps on, so the window catches up. `specserve bench
governor-sim` compares policies on a simulated batch-1 round.

A bucket not measured yet starts with the mode its nearest measured bucket prefers (batch
sizes pass through many buckets as requests finish, and measuring the slower mode first in
each is what exploration would otherwise cost), and prices its probes with that bucket's
ratios. A bucket more than NEAR ranks away is only a first guess (on a CPU a verify costs
its tokens at any batch, so speculation that pays at batch 1 costs more than plain at
batch 32): once the guessed mode has TRUSTED samples, the other is probed at once. With no
measured bucket it measures speculation first (TRUSTED samples). The worker
times a step from its start to the next step's start, so the engine's own per-step work
(outputs, detokenization) is counted, not only the forward and read-back; it records a
step once the next one has been decided, so `record` recognises the probe by its mode.

A proposer that can tell before drafting whether its drafts would pay (NGRAM: the length
of each request's match against what drafts from such matches committed, spec/ngram/gate.py)
gives `speculate` a hint, priced with `cost_ratio`; once a bucket has both modes measured
the hint decides its steps, so speculation runs where the drafts will land and plain
decoding elsewhere, with no probe to wait for when the text turns repetitive. The worker
asks for one at batch 1 only (spec/worker.py `choose`).

Both modes are exact (a plain step is the plain engine's decode step), so switching never
changes the output, only the speed.
"""
from __future__ import annotations

import bisect
import math
import statistics
import time
from collections import deque
from collections.abc import Callable

from specserve.core import parallel
from specserve.runner.cuda_graph import capture_sizes

# A probe's expected loss may be at most this share of the time its bucket ran since the
# last probe: exploring costs the engine at most ~1% of its speed where one mode is settled.
EXPLORE_SHARE = 0.01
# A step over this many times its window's median is a host pause, not a step's cost.
PAUSE = 3.0
# Switches into a mode whose median prices its probes (one slow switch is not the cost).
SWITCH_WINDOW = 5
# Samples of each mode before a bucket's estimates price its probes.
TRUSTED = 3
# The first steps of a run of one mode are no sample of its pace (see `record`).
WARM_STEPS = 2
# How many ladder ranks away a bucket's estimates may price a bucket that lacks a mode.
NEAR = 2


class SpecGovernor:
    def __init__(self, enabled: bool, probe_every: int = 32, window: int = 8, token_window: int = 128,
                 probe_steps: int = WARM_STEPS + 1, explore_share: float = EXPLORE_SHARE,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.enabled, self.probe_every, self.clock = enabled, probe_every, clock
        # A probe runs probe_steps steps in the other mode; the first WARM_STEPS say nothing
        # of the mode's steady cost (see `record`), so at least one more.
        assert probe_steps > WARM_STEPS, "a probe's first steps are warm-up steps: it needs one more"
        self.probe_steps, self.explore_share = probe_steps, explore_share
        # A mode's rate: its mean tokens per step over the step time of its last `window`
        # (`_step_time`). Tokens per step are the noisier (at batch 1 a verify commits 1 to
        # 7 tokens), so they take a longer window than the step times: a mean of 8 is noisy
        # enough to settle on the wrong mode when the two are close. The mean weighs a sample
        # by decay ** (its age in the bucket's steps): an effective window of `token_window`
        # samples while the mode runs.
        self.window, self.decay = window, 1.0 - 2.0 / (max(window, token_window) + 1)
        self._count: dict[tuple[int, bool], int] = {}  # (bucket, speculated) -> samples taken
        # (bucket, speculated) -> (weighted sum of tokens per request, sum of weights, the
        # bucket's step number when they were last updated)
        self._tokens: dict[tuple[int, bool], tuple[float, float, int]] = {}
        self._times: dict[tuple[int, bool], deque[float]] = {}  # the last `window` step times
        # (bucket, mode) -> the last SWITCH_WINDOW switches' costs into the mode (`_warm_up`),
        # and a switch whose warm-up steps are still being recorded: [seconds so far, steps]
        self._switches: dict[tuple[int, bool], deque[float]] = {}
        self._warming: dict[tuple[int, bool], list] = {}
        self._rate: dict[tuple[int, bool], float] = {}  # tokens per request per second
        self._time: dict[tuple[int, bool], float] = {}  # seconds a step (`_step_time`)
        self._steps: dict[int, int] = {}
        self._last_probe: dict[int, int] = {}  # bucket -> step number of its last probe (or first step)
        self._since: dict[int, float] = {}  # bucket -> seconds run in the chosen mode since its last probe
        self._eager: set[int] = set()  # buckets whose last probe beat the choice: the next is due soon
        self._probing: dict[int, bool] = {}  # bucket -> the choice a probe in flight tests
        self._probe_left: dict[int, int] = {}  # bucket -> steps of that probe still to run
        self._ladder = capture_sizes(4096)

    def _bucket(self, bs: int) -> int:
        return next((s for s in self._ladder if s >= bs), bs)

    def speculate(self, bs: int, hint: bool | None = None) -> bool:
        """Whether the next step over `bs` requests should draft. `hint`: the proposer's
        word on this step, when it can tell before drafting whether its drafts would pay
        at the measured price (`cost_ratio`; NGRAM's match lengths): once the bucket has
        both modes measured, it decides every step outside a probe."""
        if not self.enabled:
            return True
        b = self._bucket(bs)
        n = self._steps.get(b, 0)
        self._steps[b] = n + 1
        if hint is not None and (b, True) in self._rate and (b, False) in self._rate and b not in self._probing:
            return hint
        best = self._best(b)
        if best is None:  # nothing measured nearby: speculation until TRUSTED samples, then plain
            return self._count.get((b, True), 0) < TRUSTED
        if b in self._probing:
            if self._probe_left.get(b, 0) > 0:  # the probe goes on
                self._probe_left[b] -= 1
                return not self._probing[b]
            return best  # its steps are run: it is recorded a step late
        if not self._due(b, n, best):
            return best
        self._probing[b] = best
        self._probe_left[b] = self.probe_steps - 1
        self._last_probe[b], self._since[b] = n, 0.0
        self._eager.discard(b)
        return not best

    def leaning(self, bs: int) -> bool:
        """Whether a step over `bs` requests will likely speculate: the mode `speculate`
        prefers there (probes aside), without counting a step or scheduling a probe."""
        if not self.enabled:
            return True
        best = self._best(self._bucket(bs))
        return best is None or best

    def _best(self, b: int) -> bool | None:
        """The faster mode at bucket b: its own rates, else its nearest measured bucket's
        (None: no bucket has both)."""
        spec, plain = self._rate.get((b, True)), self._rate.get((b, False))
        if spec is not None and plain is not None:
            return spec >= plain
        near = self._nearest(b)
        return None if near is None else self._rate[(near, True)] >= self._rate[(near, False)]

    def _due(self, b: int, n: int, best: bool) -> bool:
        """Whether bucket b (at its step n, running `best`) probes the other mode now."""
        last = self._last_probe.setdefault(b, n)
        loss = self._probe_loss(b, best)
        if loss is None and self._guessed(b, best):
            return True  # a far bucket's choice: measure the other mode here at once
        if n - last < self.probe_every:
            return False
        return b in self._eager or loss is None or loss <= self.explore_share * self._since.get(b, 0.0)

    def _guessed(self, b: int, best: bool) -> bool:
        """Whether bucket b runs `best` on a far bucket's word alone (no sample of the other
        mode here) and has measured `best` enough to compare. The ratio of two modes moves
        with the batch: on a CPU a verify costs its tokens from batch 1 up, on a GPU from
        where it turns compute-bound, so speculation that pays at batch 1 may cost several times plain
        at batch 32, and probe_every steps of it there cost more than measuring plain now."""
        return (b, not best) not in self._rate and self._count.get((b, best), 0) >= TRUSTED

    def _probe_loss(self, b: int, best: bool) -> float | None:
        """Seconds a probe of the other mode at bucket b is expected to cost beyond what
        `best` would take for the same tokens. None when no estimate is trusted to price it
        (then the probe is due every `probe_every` steps, as a first measurement): the
        bucket's own, once each mode has TRUSTED samples (one slow first step, a compile,
        must not price probes out for a long time), or for a bucket missing a mode, its
        nearest measured bucket's within NEAR ranks of the ladder (a far one's ratio, batch
        1's for batch 64, is a guess: it only picks the first mode)."""
        other = not best
        ref = b if (b, other) in self._rate and (b, best) in self._rate else self._nearest(b)
        if ref is None or not self._trusted(ref) or abs(self._rank(ref) - self._rank(b)) > NEAR:
            return None
        if (b, best) not in self._time:
            return math.inf  # not one sample of the chosen mode here yet: not due
        # the other mode's step: measured here, or this bucket's chosen step scaled as at ref
        step = self._time[(b, other)] if ref == b else \
            self._time[(b, best)] * self._time[(ref, other)] / self._time[(ref, best)]
        slower = max(0.0, 1.0 - self._rate[(ref, other)] / self._rate[(ref, best)])
        return self.probe_steps * step * slower + self._switch_cost(b, ref, other) + self._switch_cost(b, ref, best)

    def _switch_cost(self, b: int, ref: int, mode: bool) -> float:
        """Seconds a switch into `mode` costs at bucket b (measured there, else at ref; 0
        before any is measured)."""
        costs = self._switches.get((b, mode)) or self._switches.get((ref, mode))
        return statistics.median(costs) if costs else 0.0

    def _trusted(self, b: int) -> bool:
        return all(self._count.get((b, mode), 0) >= TRUSTED for mode in (True, False))

    def _rank(self, b: int) -> int:
        return bisect.bisect_left(self._ladder, b)  # position on the ladder

    def record(self, bs: int, speculated: bool, tokens: int, seconds: float, switched: bool = False,
               drafted: bool = True) -> None:
        """One step over `bs` requests committed `tokens` in `seconds`; `switched`: it is
        one of the first WARM_STEPS of a run of its mode. Such a step is not a sample (what
        it takes beyond the mode's steady step prices probes: `_warm_up`). The
        first pays for the switch (the other mode's queued work drained, no tree drafted
        ahead of a verify, no decode step overlapping a plain one), so as a sample it would
        make the switched-to mode look slower than it runs. The second is cheap: it lands
        the first, which the GPU began while the host was still busy with the switch, so it
        waits for less than a step's GPU time, and as a sample it would make the mode look
        faster than it runs.
        Nor is a step that committed nothing: the first step of a pipeline (spec/pipeline.py)
        is launched and left in flight, and its tokens land with the next step; its zero
        would hold down the mean of tokens for a whole window. Nor is a speculative step
        that drafted nothing (`drafted` False: NGRAM found no match worth a draft for any
        request, so the step verified nothing and ran as a decode): as a sample it would
        price speculation by the stretches where it cannot draft, and on text that repeats
        only in places (code being edited) hold the governor on plain decoding through the
        places where every draft lands. Speculation's rate is its rate where it drafts.
        Every step still counts as time run since the last probe, and such a step ends a
        probe whose last step it is."""
        if not self.enabled or seconds <= 0:
            return
        b = self._bucket(bs)
        probe_step = b in self._probing and self._probing[b] != speculated
        if not probe_step:
            self._since[b] = self._since.get(b, 0.0) + seconds
        key = (b, speculated)
        # a warm-up missing a step (one went unrecorded) is no sample of a switch's cost
        self._warming.pop((b, not speculated), None)
        if switched:
            self._warm_up(key, seconds)
        else:
            self._warming.pop(key, None)
        if switched or tokens <= 0:
            return
        probe_ends = probe_step and not self._probe_left.get(b)  # its steps before this one were warm-ups
        if probe_ends:
            self._probing.pop(b)
        if speculated and not drafted:
            return
        times = self._times.setdefault(key, deque(maxlen=self.window))
        times.append(seconds)
        self._count[key] = self._count.get(key, 0) + 1
        # Tokens per request: a bucket spans batch sizes (9..16 is one) and a batch shrinks
        # as requests finish, so the two modes' samples may come from different sizes; per
        # batch, a mode sampled at 16 requests would outscore one sampled at 9.
        step = self._steps.get(b, 0)
        total, weight, last = self._tokens.get(key, (0.0, 0.0, step))
        age = self.decay ** (step - last)
        total, weight = total * age + tokens / bs, weight * age + 1.0
        self._tokens[key] = (total, weight, step)
        # Mean tokens (acceptance varies step to step; the mean is what a step yields) over
        # the step time.
        self._time[key] = _step_time(list(times))
        self._rate[key] = total / weight / self._time[key]
        if probe_ends:
            chosen = self._rate.get((b, not speculated))
            if chosen is not None and tokens / bs / seconds > chosen:
                self._eager.add(b)  # the step beat the choice: probe again soon, so the window catches up

    def _warm_up(self, key: tuple[int, bool], seconds: float) -> None:
        """A warm-up step of a run of key's mode. A switch into the mode costs what its
        WARM_STEPS take beyond the mode's steady step (not measured before the mode has one)."""
        run, steady = self._warming.setdefault(key, [0.0, 0]), self._time.get(key)
        if steady is None:
            del self._warming[key]
            return
        run[0] += seconds - steady
        run[1] += 1
        if run[1] == WARM_STEPS:
            del self._warming[key]
            self._switches.setdefault(key, deque(maxlen=SWITCH_WINDOW)).append(max(0.0, run[0]))

    def unmeasured(self, bs: int, speculated: bool) -> None:
        """A step that `speculate` decided will not be recorded (other work ran before the
        next step, so its cost is unknown). If it was a probe, the next step probes again:
        left in flight, the probe would block every later one in its bucket (at batch 1,
        where each request's last step precedes the next one's prefill, the governor
        then stayed on plain decoding for good)."""
        b = self._bucket(bs)
        if self._probing.get(b, speculated) != speculated:
            self._probing.pop(b)
            self._probe_left.pop(b, None)
            self._last_probe[b] = self._steps[b] - self.probe_every  # due at the next step
            self._eager.add(b)

    def _nearest(self, bucket: int) -> int | None:
        """The nearest bucket where both modes are measured (None: none is)."""
        both = [b for b in self._steps if (b, True) in self._rate and (b, False) in self._rate]
        if not both:
            return None
        return min(both, key=lambda b: (abs(self._rank(b) - self._rank(bucket)), b))

    def cost_ratio(self, bs: int) -> float | None:
        """What a speculative step over `bs` requests costs in plain steps, as measured (None:
        a mode not measured yet, or the governor off). A step that drafts pays where its
        drafts are accepted for more tokens than this."""
        b = self._bucket(bs)
        spec, plain = self._time.get((b, True)), self._time.get((b, False))
        return spec / plain if self.enabled and spec is not None and plain else None

    def rates(self, bs: int) -> tuple[float | None, float | None]:
        """(speculative, plain) tokens/s per request for a batch of `bs` (None: not measured)."""
        b = self._bucket(bs)
        return self._rate.get((b, True)), self._rate.get((b, False))


def _step_time(seconds: list[float]) -> float:
    """What a step costs: the mean of a window but its slowest step and its host pauses
    (steps over PAUSE x its median: a compile, a GC pause, is not the cost), or the median
    of fewer than 3. Not the median of the window: a pipelined speculative step at batch
    64 drains and restarts its pipeline whenever a request ends (every few steps, each
    drain about a whole step), and a median would count only the cheap steps, making a
    slower speculation look as fast as plain decoding. Pauses matter most in a mode only
    probed: its window takes one sample a probe, so two pauses in it (the slowest step
    aside) would stay for many probes."""
    if len(seconds) < 3:
        return statistics.median(seconds)
    slowest = max(seconds)
    if slowest > PAUSE * min(seconds):  # else no step is over PAUSE x the median: skip sorting
        median = statistics.median(seconds)
        seconds = [s for s in seconds if s <= PAUSE * median]
        if len(seconds) < 3:
            return statistics.median(seconds)
        slowest = max(seconds)
    return (sum(seconds) - slowest) / (len(seconds) - 1)


class RankZeroGovernor:
    """Under tensor parallelism the governor's choices are rank 0's: its clock differs from
    the others', and every rank must run the same steps (core/parallel.py). Rank 0's
    `speculate` and `leaning` are broadcast; everything else is the wrapped governor's."""

    def __init__(self, inner: SpecGovernor) -> None:
        self.inner = inner

    def speculate(self, bs: int, hint: bool | None = None) -> bool:
        return parallel.broadcast_flag(self.inner.speculate(bs, hint) if parallel.tp_rank() == 0 else False)

    def leaning(self, bs: int) -> bool:
        return parallel.broadcast_flag(self.inner.leaning(bs) if parallel.tp_rank() == 0 else False)

    def cost_ratio(self, bs: int) -> float | None:
        """None: each rank's clock would price drafts its own way, and the ranks' drafts
        (NGRAM's, from one trie on every rank) would part."""
        return None

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def make_governor(adaptive: bool) -> SpecGovernor | RankZeroGovernor:
    """The governor a worker consults: rank 0's choices under tensor parallelism."""
    governor = SpecGovernor(adaptive)
    return RankZeroGovernor(governor) if adaptive and parallel.tp_size() > 1 else governor
