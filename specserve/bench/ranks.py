"""Run a benchmark body on N tensor-parallel GPU ranks (NCCL), one process per GPU, and
collect what each returns: how `bench limit --tp-sizes` times a sharded model with the
engine's own group set-up (engine/tp_group.py). Rank r uses GPU r."""
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


def run_on_ranks(fn: Callable[..., Any], tp: int, *args: Any) -> list[Any]:
    """[fn(*args) on rank 0, ..., rank tp-1]; RuntimeError with a rank's traceback."""
    ctx = mp.get_context("spawn")
    addr, results = f"127.0.0.1:{free_port()}", ctx.Queue()
    procs = [ctx.Process(target=_main, args=(fn, RankPlace(tp, r, addr, r), results, args)) for r in range(tp)]
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
        assert place.gpu is not None
        use_gpu(place.gpu)
        if place.tp_size > 1:
            join_tp_group(place)
        results.put((place.rank, pickle.dumps(fn(*args)), None))
    except BaseException:  # noqa: BLE001 - reported to the caller
        results.put((place.rank, None, traceback.format_exc()))
