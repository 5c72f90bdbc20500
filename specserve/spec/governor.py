"""Turning speculation down when it does not pay (DESIGN 3.4: never slower than plain).

Speculation pays when accepted tokens per second beat plain decoding's tokens per
second, and both depend on the batch size (a verify of N tokens per request is almost
free at batch 1 and costs ~N decode steps once the GPU is compute-bound) and on the
traffic (how often drafts are accepted). So the governor measures instead of modelling:
per batch-size bucket it keeps an exponential moving average of committed tokens per
second for speculative steps and for plain steps (a root-only verify, which is a
decode), runs the better mode, and probes the other one every `probe_every` steps so
the estimate follows the traffic. Timings come from the host clock around a step,
which ends in the step's one read-back, so they cover the GPU work.

Both modes are exact (a plain step is a verify of the root alone), so switching never
changes the output, only the speed.
"""
from __future__ import annotations

import time
from typing import Callable

from specserve.runner.cuda_graph import capture_sizes


class SpecGovernor:
    def __init__(self, enabled: bool, probe_every: int = 32, alpha: float = 0.25,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.enabled, self.probe_every, self.alpha, self.clock = enabled, probe_every, alpha, clock
        self._rate: dict[tuple[int, bool], float] = {}  # (bucket, speculated) -> tokens/s EMA
        self._steps: dict[int, int] = {}
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
        if spec is None:
            return True  # optimistic: measure speculation first
        if plain is None:
            return False
        best = spec >= plain
        return (not best) if n % self.probe_every == 0 else best

    def record(self, bs: int, speculated: bool, tokens: int, seconds: float) -> None:
        """One step over `bs` requests committed `tokens` in `seconds`."""
        if not self.enabled or seconds <= 0:
            return
        key = (self._bucket(bs), speculated)
        rate = tokens / seconds
        old = self._rate.get(key)
        self._rate[key] = rate if old is None else (1 - self.alpha) * old + self.alpha * rate

    def rates(self, bs: int) -> tuple[float | None, float | None]:
        """(speculative, plain) tokens/s estimates for a batch of `bs` (None: not measured)."""
        b = self._bucket(bs)
        return self._rate.get((b, True)), self._rate.get((b, False))
