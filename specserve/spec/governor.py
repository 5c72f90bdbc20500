"""Turning speculation down when it does not pay (DESIGN 3.4: never slower than plain).

Speculation pays when accepted tokens per second beat plain decoding's tokens per
second, and both depend on the batch size (a verify of N tokens per request is almost
free at batch 1 and costs ~N decode steps once the GPU is compute-bound) and on the
traffic (how often drafts are accepted). So the governor measures instead of modelling:
per batch-size bucket it keeps each mode's rate (mean tokens per request of its last 64 steps over
the median seconds of its last 8: at batch 1 a verify commits 1 to 6 tokens, so fewer
steps give a noisy mean), runs the better mode, and probes the other one so the estimate
follows the traffic. Probes back off: a probe that confirms a clear choice (the chosen
mode more than CLOSE_CALL times faster) doubles the wait before the next one (from
`probe_every` up to `max_backoff` times it), or goes straight to the longest wait when
the chosen mode is more than twice as fast (a probe then costs most and is least likely
to flip); a close call, or a probe step faster than the chosen mode, keeps the wait at
`probe_every`, so the probed mode's estimate keeps up. A settled bucket spends well
under 1% of its steps in a clearly slower mode, and about 3% in one that is close.
A bucket not measured yet starts with the mode its nearest measured bucket prefers (batch
sizes pass through many buckets as requests finish, and measuring the slower mode first in
each is what exploration would otherwise cost); with no measured bucket it measures
speculation first. The worker times a step from its start to the next step's start, so
the engine's own per-step work (outputs, detokenization) is counted, not only the forward
and read-back; it records a step once the next one has been decided, so `record`
recognises the probe by its mode.

Both modes are exact (a plain step is the plain engine's decode step), so switching never
changes the output, only the speed.
"""
from __future__ import annotations

import bisect
import statistics
import time
from collections import deque
from typing import Callable

from specserve.runner.cuda_graph import capture_sizes

# Within this factor the two modes are a close call: probes do not back off, so the
# probed mode's estimate keeps up (a probe then costs at most this much on 1 step in 32).
CLOSE_CALL = 1.2


class SpecGovernor:
    def __init__(self, enabled: bool, probe_every: int = 32, window: int = 8, token_window: int = 64,
                 max_backoff: int = 8, probe_steps: int = 2, clock: Callable[[], float] = time.perf_counter) -> None:
        self.enabled, self.probe_every, self.clock = enabled, probe_every, clock
        # A probe runs probe_steps steps in the other mode; the first is a switch step (see
        # `record`), which says nothing of the mode's steady cost, so at least two.
        assert probe_steps >= 2, "a probe's first step is a switch step: it needs a second"
        self.probe_steps = probe_steps
        # A mode's rate: mean tokens of its last `token_window` steps over the median time of
        # its last `window`. Step times are steady; tokens per step are not (at batch 1 a
        # verify commits 1 to 6 tokens), and a mean of 8 was noisy enough (+-18%) to
        # settle on plain decoding when speculation was 1.2x faster.
        self.window, self.token_window = window, max(window, token_window)
        self.max_wait = probe_every * max_backoff
        self._samples: dict[tuple[int, bool], deque[tuple[int, float]]] = {}  # (bucket, speculated) -> (tokens, s)
        self._rate: dict[tuple[int, bool], float] = {}  # their medians
        self._steps: dict[int, int] = {}
        self._wait: dict[int, int] = {}  # bucket -> steps between probes
        self._next_probe: dict[int, int] = {}  # bucket -> step number of the next probe
        self._probing: dict[int, bool] = {}  # bucket -> the choice a probe in flight tests
        self._probe_left: dict[int, int] = {}  # bucket -> steps of that probe still to run
        self._ladder = capture_sizes(4096)

    def _bucket(self, bs: int) -> int:
        return next((s for s in self._ladder if s >= bs), bs)

    def speculate(self, bs: int) -> bool:
        """Whether the next step over `bs` requests should draft."""
        if not self.enabled:
            return True
        b = self._bucket(bs)
        n = self._steps.get(b, 0)
        self._steps[b] = n + 1
        spec, plain = self._rate.get((b, True)), self._rate.get((b, False))
        if spec is None or plain is None:
            ratio = self._nearest_ratio(b)
            if ratio is None:  # nothing measured nearby: speculation for two steps, then plain
                return spec is None or n < 2
            best = ratio >= 1.0  # the other mode is measured at this bucket's first probe
        else:
            best = spec >= plain
        if b in self._probing:
            if self._probe_left.get(b, 0) > 0:  # the probe goes on
                self._probe_left[b] -= 1
                return not self._probing[b]
            return best  # its steps are run: it is recorded a step late
        if n < self._next_probe.setdefault(b, n + self.probe_every):
            return best  # not due
        self._probing[b] = best
        self._probe_left[b] = self.probe_steps - 1
        return not best

    def leaning(self, bs: int) -> bool:
        """Whether a step over `bs` requests will likely speculate: the mode `speculate`
        prefers there (probes aside), without counting a step or scheduling a probe."""
        if not self.enabled:
            return True
        b = self._bucket(bs)
        spec, plain = self._rate.get((b, True)), self._rate.get((b, False))
        if spec is None or plain is None:
            ratio = self._nearest_ratio(b)
            return ratio is None or ratio >= 1.0
        return spec >= plain

    def record(self, bs: int, speculated: bool, tokens: int, seconds: float, switched: bool = False) -> None:
        """One step over `bs` requests committed `tokens` in `seconds`; `switched`: the step
        before it ran in the other mode. Such a step is not a sample: it pays for the switch
        (the other mode's queued work drained, no tree drafted ahead of a verify, no decode
        step overlapping a plain one), so as a probe's only step it made a speculation 1.3x
        faster at batch 1 look no faster than plain decoding (H100, SmolLM2 + EAGLE-3).
        Nor is a step that committed nothing: the first step of a pipeline (spec/pipeline.py)
        is launched and left in flight, and its tokens land with the next step. Taken as a
        sample, its zero stayed in the mean of tokens for 64 steps: a fresh engine at batch
        1 ran ~90 plain steps before speculation, 3.5x faster, won (H100, SmolLM2 +
        EAGLE-3)."""
        if not self.enabled or seconds <= 0 or switched or tokens <= 0:
            return
        b = self._bucket(bs)
        samples = self._samples.setdefault((b, speculated), deque(maxlen=self.token_window))
        # Tokens per request: a bucket spans batch sizes (9..16 is one) and a batch shrinks
        # as requests finish, so the two modes' samples may come from different sizes; per
        # batch, a mode sampled at 16 requests would outscore one sampled at 9.
        samples.append((tokens / bs, seconds))
        recent = list(samples)[-self.window:]
        # Mean tokens (acceptance varies step to step; the mean is what a step yields) over
        # the median time (one slow step, a compile or a GC pause, is not the cost).
        self._rate[(b, speculated)] = rate = statistics.fmean(t for t, _ in samples) / statistics.median(
            x for _, x in recent)
        if self._probing.get(b, speculated) != speculated and not self._probe_left.get(b):
            # the probe's last step: back off if it confirmed the choice
            self._probing.pop(b)
            chosen = self._rate.get((b, not speculated))
            # The choice follows the windows; the wait also heeds the step alone, so a
            # probe that beat the chosen mode (a change of traffic, or luck at batch 1,
            # where one step says little) is repeated soon and the window catches up.
            confirmed = chosen is not None and rate <= chosen and tokens / bs / seconds <= chosen
            wait = self.probe_every
            if confirmed and chosen > CLOSE_CALL * rate:  # a close call keeps its samples coming
                wait = min(2 * self._wait.get(b, self.probe_every), self.max_wait)
            if confirmed and chosen > 2 * rate:
                wait = self.max_wait
            self._wait[b] = wait
            self._next_probe[b] = self._steps[b] - 1 + wait  # counted from the probe step

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

    def _nearest_ratio(self, bucket: int) -> float | None:
        """spec / plain tokens/s of the nearest bucket where both are measured (None: none is)."""
        both = [b for b in self._steps if (b, True) in self._rate and (b, False) in self._rate]
        if not both:
            return None
        rank = lambda b: bisect.bisect_left(self._ladder, b)  # noqa: E731  (position on the ladder)
        near = min(both, key=lambda b: (abs(rank(b) - rank(bucket)), b))
        return self._rate[(near, True)] / self._rate[(near, False)]

    def rates(self, bs: int) -> tuple[float | None, float | None]:
        """(speculative, plain) tokens/s per request for a batch of `bs` (None: not measured)."""
        b = self._bucket(bs)
        return self._rate.get((b, True)), self._rate.get((b, False))
