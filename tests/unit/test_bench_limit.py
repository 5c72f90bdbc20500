"""`specserve bench limit`'s runner loop on the CPU: the figures come out and every slot
it took goes back (the benchmark itself needs a GPU: its model is 8B-shaped)."""
from __future__ import annotations

from specserve.bench import limit


def test_runner_loop_times_decode_and_verify_and_frees_its_slots(engine_no_leak) -> None:
    sched = engine_no_leak.scheduler
    step_s, kv_mid, ratio, graph_us = limit._decode(sched.runner, sched.kv, prompt_len=8, steps=3)
    assert step_s > 0 and ratio > 0 and 8 < kv_mid < 8 + 1 + 8 + 3
    assert graph_us == (0.0, 0.0) and limit._graph_note(graph_us) == "no graphs"  # no CUDA graphs here
    assert limit._graph_note((5410.0, 6397.0)) == "graphs: 6397 / 5410 us = 1.182x"
