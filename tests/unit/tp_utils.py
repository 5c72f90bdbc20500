"""Run a function on N tensor-parallel CPU ranks (gloo) in fresh processes, and collect
what each returns. The function must be importable (module level) and picklable results."""
from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

RANK_TIMEOUT_S = 300


def run_ranks(fn: Callable[..., Any], tp: int, *args: Any) -> list[Any]:
    """[fn(*args) on rank 0, ..., on rank tp-1]; raises with a rank's traceback if it failed."""
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results: Any = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(fn, tp, r, port, results, args), daemon=True)
             for r in range(tp)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        for _ in range(tp):
            rank, value, error = results.get(timeout=RANK_TIMEOUT_S)
            if error is not None:
                raise AssertionError(f"rank {rank} failed:\n{error}")
            got[rank] = pickle.loads(value)
    except queue.Empty:
        raise AssertionError(f"ranks did not finish in {RANK_TIMEOUT_S} s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(tp)]


def _rank_main(fn, tp: int, rank: int, port: int, results, args) -> None:
    import torch
    import torch.distributed as dist

    from specserve.core import parallel

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=tp, rank=rank)
        parallel.set_tp(parallel.TPGroup(tp, rank, dist.group.WORLD, dist.group.WORLD))
        # plain pickle bytes: a tensor put on the queue as is would live in shared memory
        # that this process takes with it when it exits
        results.put((rank, pickle.dumps(fn(*args)), None))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, None, traceback.format_exc()))
