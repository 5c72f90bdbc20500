"""The step watchdog (SGLang's --watchdog-timeout): an engine step that never ends stops the
server instead of hanging it.

`StepClock` is one float in shared memory per engine process: the engine writes when its
current step began (0.0 while it has no work) and the front end's watcher reads it. While
work remains after a step, the clock runs on until the next step begins, so a process
stopped between two steps (sending its outputs, reading its pipe) is seen as well. The watcher
lives in the front end, not beside the step, so that it still sees a process that holds
its GIL, is stopped, or waits forever in a collective. It only reads; what to do with a
stuck process (kill it, fail its requests, exit non-zero) is the client's.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class StepClock:
    def __init__(self, ctx: Any = None) -> None:
        self._began = (ctx or mp).Value("d", 0.0, lock=False)  # CLOCK_MONOTONIC is shared by processes

    @contextmanager
    def step(self, still_busy: Callable[[], bool] = lambda: False) -> Iterator[None]:
        """The engine side: time the block as one step. The clock stops at its end unless
        `still_busy()` says work remains: then it runs until the next step or `stop`."""
        self._began.value = time.monotonic()
        try:
            yield
        finally:
            if not still_busy():
                self._began.value = 0.0

    def stop(self) -> None:
        """The engine side: no work (nor step) in progress."""
        self._began.value = 0.0

    def stuck_for(self, now: float | None = None) -> float:
        """Seconds the current step has run (0.0 between steps)."""
        began = self._began.value
        return 0.0 if began == 0.0 else (time.monotonic() if now is None else now) - began
