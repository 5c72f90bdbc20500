"""Run a function on N tensor-parallel ranks, one fresh process each, and collect what each
returns: how `bench limit --tp-sizes` times a sharded model with the engine's own group
set-up (engine/tp_group.py), and how the tests run CPU ranks. Rank r uses GPU r (NCCL), or
with on_gpu False the CPU (gloo, one torch thread each). Results travel as plain pickle
bytes: a tensor put on the queue as is would live in shared memory that its process takes
with it when it exits."""
from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import traceback
from collections.abc import Callable
from typing import Any

from specserve.engine.protocol import RankPlace
from specserve.engine.ranks import free_port

TIMEOUT_S = 1800


def run_on_ranks(fn: Callable[..., Any], tp: int, *args: Any, on_gpu: bool = True) -> list[Any]:
    """[fn(*args) on rank 0, ..., rank tp-1]; RuntimeError with a rank's traceback."""
    ctx = mp.get_context("spawn")
    addr, results = f"127.0.0.1:{free_port()}", ctx.Queue()
    places = [RankPlace(tp, r, addr, r if on_gpu else None) for r in range(tp)]
    procs = [ctx.Process(target=_main, args=(fn, place, results, args), daemon=True) for place in places]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        for _ in range(tp):
            rank, value, error = results.get(timeout=TIMEOUT_S)
            if error is not None:
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            got[rank] = pickle.loads(value)
    except queue.Empty:
        raise RuntimeError(f"the ranks did not finish in {TIMEOUT_S} s") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(tp)]


def _main(fn, place: RankPlace, results, args) -> None:
    from specserve.engine.process import use_gpu
    from specserve.engine.tp_group import join_tp_group

    try:
        if place.gpu is not None:
            use_gpu(place.gpu)
        else:
            import torch

            torch.set_num_threads(1)
        if place.tp_size > 1:
            join_tp_group(place)
        results.put((place.rank, pickle.dumps(fn(*args)), None))
    except BaseException:  # noqa: BLE001 - reported to the caller
        results.put((place.rank, None, traceback.format_exc()))
