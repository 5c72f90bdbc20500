"""A replica's engine processes: one per tensor-parallel rank, started, watched and stopped
together.

**Process model.** Every rank runs the same scheduler on the same inputs. Rank 0 alone
talks to the front end (two pipes); each loop iteration it broadcasts what it read
(requests, aborts, control questions, the stop) to the other ranks, and every rank then
handles the same messages and runs the same step (engine/process.py). We chose this over
"rank 0 decides and ships each batch" because a speculative step is many forwards (draft
steps, verify, draft extend, the next tree) whose shapes come from host state in the
proposers: replaying the scheduler keeps that state on every rank with no traffic per
forward, and a step captured in a CUDA graph is one replay on each rank. SGLang's
scheduler does the same. What could differ between ranks is made equal: the KV budget (the
smallest rank's), the seeds of unseeded requests (one scheduler seed, rank 0's), the radix
cache's recency (a logical clock), and the governor's timed choices (rank 0's, broadcast
per step). NGRAM's trie is host state fed the same tokens on every rank, so each rank
drafts the same trees without a broadcast.

**Placement.** `--tp-size` ranks per replica, spread over `--nnodes` hosts (rank r on node
r // (tp / nnodes)); on GPUs, replica d's local rank i uses GPU base_gpu_id + d * (tp /
nnodes) + i. A replica's ranks meet at `--dist-init-addr` across hosts, else at a free
port on 127.0.0.1.

**Failure.** A rank that exits takes its replica down: `dead()` names it, the owner stops
the others (terminate, then kill) and ends the server with an error. So does a rank whose
step outlasts --watchdog-timeout (`stuck()`, from each rank's `StepClock`). Peers blocked in a
collective with a dead rank are not waited for.
"""
from __future__ import annotations

import multiprocessing as mp
import signal
import socket
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection

from specserve.core.config import Config
from specserve.engine.process import engine_main
from specserve.engine.protocol import EngineStart, ModelInfo, RankPlace
from specserve.engine.watchdog import StepClock

START_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Layout:
    """How the ranks of every replica sit on this machine."""

    tp_size: int
    nnodes: int
    node_rank: int
    base_gpu_id: int
    on_gpu: bool
    dist_init_addr: str | None
    dp_size: int = 1

    @classmethod
    def of(cls, cfg: Config, on_gpu: bool) -> Layout:
        r = cfg.runner
        return cls(r.tp_size, r.nnodes, r.node_rank, r.base_gpu_id, on_gpu, r.dist_init_addr, r.dp_size)

    @property
    def per_node(self) -> int:
        return self.tp_size // self.nnodes

    def check_gpus(self, replicas: int) -> None:
        """RuntimeError, before any process starts, if this host has too few GPUs."""
        if not self.on_gpu:
            return
        import torch

        need, have = self.base_gpu_id + replicas * self.per_node, torch.cuda.device_count()
        if need > have:
            raise RuntimeError(f"{replicas} replica(s) of {self.per_node} rank(s) from GPU {self.base_gpu_id} "
                               f"need {need} GPUs on this host; {have} found")

    def places(self, replica: int) -> list[RankPlace]:
        """This node's ranks of `replica`."""
        addr = self.dist_init_addr or f"127.0.0.1:{free_port()}"
        first = self.node_rank * self.per_node
        return [RankPlace(self.tp_size, first + i, addr,
                          self.base_gpu_id + replica * self.per_node + i if self.on_gpu else None,
                          self.dp_size * self.per_node)
                for i in range(self.per_node)]


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block ends (then they arrive as they would have).

    `Process.start()` writes the child's start-up pickle into a pipe; a handler that raises
    halfway through that write left the child, which reads the pickle before any of our
    code runs, to die with an EOFError traceback. Python-level handlers only (a blocked
    signal mask would be inherited by the child); off the main thread there are none."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    saved = {sig: signal.signal(sig, lambda s, _frame: caught.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        for first in caught[:1]:
            signal.raise_signal(first)


class Replica:
    """This node's processes of one engine replica; when rank 0 is among them, the front
    ends' sides of its pipes: `inboxes[k]` (to the engine) and `outboxes[k]` (from it) for
    front end k, the first pair also as `inbox` and `outbox`."""

    def __init__(self, start: EngineStart, places: list[RankPlace], index: int = 0, fronts: int = 1) -> None:
        ctx = mp.get_context("spawn")
        self.index, self.places = index, places
        self.inboxes: list[Connection] = []
        self.outboxes: list[Connection] = []
        self.procs: list = []
        self.clocks = [StepClock(ctx) for _ in places]  # the step watchdog's (engine/watchdog.py)
        for place, clock in zip(places, self.clocks):
            ends: tuple[list[Connection] | None, list[Connection] | None] = (None, None)
            if place.rank == 0:
                to_engine = [ctx.Pipe(duplex=False) for _ in range(fronts)]  # (engine's end, front end's)
                from_engine = [ctx.Pipe(duplex=False) for _ in range(fronts)]  # (front end's, engine's)
                self.inboxes = [w for _, w in to_engine]
                self.outboxes = [r for r, _ in from_engine]
                ends = ([r for r, _ in to_engine], [w for _, w in from_engine])
            name = f"specserve-engine-{index}" + (f"-tp{place.rank}" if place.tp_size > 1 else "")
            proc = ctx.Process(target=engine_main, args=(start, place, *ends, clock), daemon=True,
                               name=name)
            with signals_held():
                proc.start()
            self.procs.append(proc)
            for group in ends:
                for end in group or []:
                    end.close()
        self.inbox = self.inboxes[0] if self.inboxes else None
        self.outbox = self.outboxes[0] if self.outboxes else None

    def wait_ready(self) -> ModelInfo:
        """Block until rank 0 serves; RuntimeError if any rank exits first or it fails."""
        assert self.outbox is not None, "rank 0 runs elsewhere"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.outbox.poll(0.5):
            dead = self.dead()
            if dead is not None:
                raise RuntimeError(f"{dead} during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError("the engine process did not start in time")
        try:
            kind, payload = self.outbox.recv()
        except EOFError:
            raise RuntimeError(f"{self.dead() or 'the engine process closed its pipe'} during start-up") from None
        if kind == "error":
            raise RuntimeError(f"the engine failed to start: {payload}")
        return payload

    def sentinels(self) -> list[int]:
        return [p.sentinel for p in self.procs]

    def dead(self, sentinels: Collection[int] = ()) -> str | None:
        """Which process has exited, in words (one whose sentinel is in `sentinels` first:
        the first to go, not a peer that failed after it); None while all run. A fired
        sentinel means exited even while is_alive() still says otherwise: another thread
        may be reaping the same process (its waitpid wins, ours reads "still running")."""
        for i, proc in enumerate(self.procs):
            if proc.sentinel in sentinels:
                proc.join(timeout=2)  # its sentinel fires as it exits, a moment before it can be reaped
                return self._exited(i)
        return next((self._exited(i) for i, p in enumerate(self.procs) if not p.is_alive()), None)

    def _exited(self, i: int) -> str:
        code = self.procs[i].exitcode
        return f"{self._who(i)} exited" + (f" (code {code})" if code is not None else "")

    def stuck(self, timeout_s: float) -> str | None:
        """Which process has been in one step for more than `timeout_s`, in words; None if none."""
        for i, clock in enumerate(self.clocks):
            if clock.stuck_for() > timeout_s:
                return f"{self._who(i)} has spent more than {timeout_s:g} s in one step (--watchdog-timeout)"
        return None

    def _who(self, i: int) -> str:
        place = self.places[i]
        who = f"tensor-parallel rank {place.rank}" if place.tp_size > 1 else "the engine process"
        return who + (f" of replica {self.index}" if self.index else "")

    def stop(self, grace_s: float = 5) -> None:
        """Ask rank 0 to stop (when it is here), wait `grace_s`, then terminate, then kill;
        with no grace, kill at once (a stuck or stopped process would not heed SIGTERM)."""
        if self.inbox is not None:
            try:
                self.inbox.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive() and grace_s > 0:
                proc.terminate()
            elif proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=3)
            if proc.is_alive():
                proc.kill()
                proc.join()
