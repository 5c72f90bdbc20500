"""The front-end processes beyond the launcher's (--tokenizer-worker-num N: N - 1 of them).

One HTTP process parses, tokenizes and streams every request of the server on one event
loop; with many replicas or a small model that loop, not the engines, sets the pace
(docs/benchmarks.md). Each front end here serves the launcher's listening socket (the
kernel hands each connection to one of them) with an `EngineLink` of its own: its own
pipe pair to every replica's rank 0 (`engine/fronts.py` answers each request on its
sender's pipe), its own router and tokenizer. The launcher keeps the engine processes.

Lifetime: the launcher starts these once the engines serve and stops them (SIGTERM:
uvicorn's graceful shutdown, as for the launcher's own server; then kill) before it stops
the engines. One that exits while serving stops the server with an error, as an engine
process does. One whose launcher is gone stops itself; one whose engine pipe closes fails
its waiting requests and stops.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from specserve.engine.client import ProcessEngineClient
from specserve.engine.link import EngineLink
from specserve.engine.process import setup_logging
from specserve.engine.protocol import ModelInfo
from specserve.engine.ranks import signals_held
from specserve.server.uvicorn_server import SLACK_S
from specserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("specserve")
PARENT_POLL_S = 1.0


class FrontEnds:
    """Front ends 1..N-1 of `client`'s engines, on `sock`; `on_death(why)` when one exits
    while serving."""

    def __init__(self, client: ProcessEngineClient, tokenizer: Tokenizer, sock: socket.socket,
                 on_death: Callable[[str], None]) -> None:
        self._closing = False
        self._on_death = on_death
        self.procs: list = []
        ctx = mp.get_context("spawn")
        for front in range(1, client.config.server.tokenizer_worker_num):
            pipes = client.front_pipes(front)
            proc = ctx.Process(target=front_main, args=(client.config, tokenizer, client.info, front, pipes, sock,
                                                        os.getpid()),
                               daemon=True, name=f"specserve-frontend-{front}")
            with signals_held():
                proc.start()
            for to_engine, from_engine in pipes:  # the front end's now: its exit must close them
                to_engine.close()
                from_engine.close()
            self.procs.append(proc)
        if self.procs:
            threading.Thread(target=self._watch, daemon=True, name="frontend-watch").start()

    def _watch(self) -> None:
        ready = wait([p.sentinel for p in self.procs])
        if self._closing:
            return
        proc = next(p for p in self.procs if p.sentinel in ready)
        proc.join(timeout=2)
        self._on_death(f"front-end process {proc.name} exited (code {proc.exitcode})")

    def terminate(self) -> None:
        """Tell every front end to shut down as the launcher's server does (SIGTERM)."""
        self._closing = True
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()

    def stop(self, grace_s: float) -> None:
        """`terminate`, wait up to `grace_s` + SLACK_S for their running requests, then
        kill what is left."""
        self.terminate()
        deadline = time.monotonic() + grace_s + SLACK_S
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=3)


def front_main(config, tokenizer: Tokenizer, info: ModelInfo, front: int,
               pipes: list[tuple[Connection, Connection]], sock: socket.socket, parent: int) -> None:
    """Front end `front`: serve HTTP on `sock` until told to stop, the launcher goes, or
    an engine pipe closes."""
    from specserve.server.uvicorn_server import draining_server

    setup_logging(config.server.log_level if config.server.log_level != "info" else "warning")
    os.setpgrp()  # a terminal's Ctrl-C reaches the launcher's group alone; it then sends SIGTERM here
    server = None

    def stop(_why: str) -> None:
        if server is not None:
            server.should_exit = True

    link = EngineLink(config, tokenizer, info, pipes, front, on_death=stop)
    server = draining_server(link)
    threading.Thread(target=_watch_parent, args=(parent, stop), daemon=True, name="parent-watch").start()
    try:
        server.run(sockets=[sock])
    finally:
        link.shutdown()


def _watch_parent(parent: int, stop: Callable[[str], None]) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    stop("the launcher is gone")
