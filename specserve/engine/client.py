"""ProcessEngineClient: the launcher's front end, which owns the engine processes.

An `EngineLink` (link.py: routing, streams, control) that first starts the `--dp-size`
replicas (each `--tp-size` processes, engine/ranks.py), each rank 0 with a pipe pair per
front end (--tokenizer-worker-num; this one uses the first, `frontends.py` hands out the
rest). A watcher thread waits on every engine process (and, every WATCH_POLL_S, the step
watchdog's clocks): if one exits, or stays in one step longer than --watchdog-timeout,
while serving, every waiting request ends with an abort, `is_alive()` turns False, the
other processes are stopped and `on_death` (the launcher's: stop the server with an
error) is called with what happened.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from specserve.engine.link import EngineLink
from specserve.engine.merge import merge_model_info
from specserve.engine.protocol import EngineStart
from specserve.engine.ranks import Layout, Replica
from specserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("specserve")
WATCH_POLL_S = 1.0


class ProcessEngineClient(EngineLink):
    def __init__(self, start: EngineStart, tokenizer: Tokenizer,
                 on_death: Callable[[str], None] | None = None) -> None:
        """Start the engine replicas on what start-up resolved (preflight.py) and wait
        until they serve; RuntimeError if one fails to start."""
        config = start.config
        layout = Layout.of(config, on_gpu(config))
        layout.check_gpus(config.runner.dp_size)
        self._replicas: list[Replica] = []
        try:
            for d in range(config.runner.dp_size):  # all load at once
                self._replicas.append(Replica(start, layout.places(d), d, config.server.tokenizer_worker_num))
            infos = [r.wait_ready() for r in self._replicas]
        except BaseException:  # a failed start, or Ctrl-C / SIGTERM while loading: no orphan
            self._stop_all(grace_s=0)
            raise
        pipes = [(r.inboxes[0], r.outboxes[0]) for r in self._replicas]
        super().__init__(config, tokenizer, merge_model_info(infos), pipes, 0, on_death)
        threading.Thread(target=self._watch, daemon=True, name="engine-watch").start()

    def front_pipes(self, front: int) -> list[tuple[Connection, Connection]]:
        """Front end `front`'s (to, from) pipe ends, one pair per replica."""
        return [(r.inboxes[front], r.outboxes[front]) for r in self._replicas]

    def _pipe_closed(self, d: int) -> None:
        replica = self._replicas[d]
        # A process that exited closed its pipe; its sentinel says so even while the watcher
        # thread is the one reaping it (is_alive() would still say True here).
        exited = {s for s in wait(replica.sentinels(), timeout=2) if isinstance(s, int)}
        self._died(replica.dead(exited) or f"replica {d}'s engine closed its pipe")

    def _watch(self) -> None:
        """Wait on every engine process; also the step watchdog (engine/watchdog.py)."""
        sentinels = [s for r in self._replicas for s in r.sentinels()]
        limit = self.config.server.watchdog_timeout
        while not (ready := wait(sentinels, timeout=min(WATCH_POLL_S, limit))):
            if (stuck := next((w for r in self._replicas if (w := r.stuck(limit)) is not None), None)):
                self._died(stuck, grace_s=0)  # a stuck process reads no stop message
                return
        exited = {s for s in ready if isinstance(s, int)}
        self._died(next((d for r in self._replicas if (d := r.dead(exited)) is not None), "an engine process exited"))

    def _after_death(self, grace_s: float) -> None:
        threading.Thread(target=self._stop_all, args=(grace_s,), daemon=True, name="engine-stop").start()

    def is_alive(self) -> bool:
        return super().is_alive() and all(r.dead() is None for r in self._replicas)

    def shutdown(self) -> None:
        """Stop every engine process and wait for them (at most ~10 s)."""
        super().shutdown()
        self._stop_all()

    def _stop_all(self, grace_s: float = 5) -> None:
        self._closing = True
        for r in self._replicas:
            r.stop(grace_s)


def on_gpu(cfg: Any) -> bool:
    """Whether the engine runs on CUDA (--device, or auto with a GPU present)."""
    if cfg.model.device != "auto":
        return cfg.model.device == "cuda"
    import torch

    return bool(torch.cuda.is_available())
