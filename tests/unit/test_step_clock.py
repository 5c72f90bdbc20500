"""The step watchdog's clock (engine/watchdog.py): stopped while there is no work, running
through a step, and, while work remains, on through the gap to the next step, so that an
engine stopped between two steps (sending its outputs, reading its pipe) is seen stuck."""
from __future__ import annotations

import time

from specserve.engine.watchdog import StepClock


def test_a_step_with_nothing_left_stops_the_clock():
    clock = StepClock()
    assert clock.stuck_for() == 0.0
    with clock.step():
        now = time.monotonic()
        assert 0.0 <= clock.stuck_for(now + 5) - 5 <= 1.0
    assert clock.stuck_for() == 0.0


def test_work_left_keeps_the_clock_running_until_the_next_step_or_stop():
    clock = StepClock()
    with clock.step(still_busy=lambda: True):
        began = time.monotonic()
    assert clock.stuck_for(began + 3) >= 3 - 1.0  # between two steps: still timed from the last one's start
    with clock.step(still_busy=lambda: True):
        again = time.monotonic()
    assert clock.stuck_for(again + 1) <= 1.0 + 1e-3  # the next step restarts it
    clock.stop()
    assert clock.stuck_for() == 0.0


def test_a_failing_step_still_sets_the_clock_as_the_work_says():
    clock = StepClock()
    try:
        with clock.step(still_busy=lambda: False):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert clock.stuck_for() == 0.0
