"""Replica.dead() names the process that exited even when another thread reaps it first
(engine/ranks.py): the front end's watch and its pipe reader both join rank 0."""
from __future__ import annotations

import multiprocessing as mp
import os
import threading

from specserve.engine.protocol import RankPlace
from specserve.engine.ranks import Replica


def _exit_at_once() -> None:
    os._exit(3)


def _replica_of(proc: mp.Process) -> Replica:
    replica = object.__new__(Replica)
    replica.index, replica.procs = 0, [proc]
    replica.places = [RankPlace(1, 0, "127.0.0.1:0", None, 1)]
    return replica


def test_a_fired_sentinel_is_an_exit_even_when_another_thread_reaped_it():
    proc = mp.get_context("spawn").Process(target=_exit_at_once, daemon=True)
    proc.start()
    os.waitpid(proc.pid, 0)  # another reaper won: this Process object can no longer learn its code
    assert proc.is_alive()  # what fooled the watch before
    assert _replica_of(proc).dead({proc.sentinel}) == "the engine process exited"


def test_two_threads_waiting_on_one_exit_both_name_it():
    proc = mp.get_context("spawn").Process(target=_exit_at_once, daemon=True)
    proc.start()
    replica, said = _replica_of(proc), []
    threads = [threading.Thread(target=lambda: said.append(replica.dead({proc.sentinel}))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert said and all(s.startswith("the engine process exited") for s in said), said
