"""`python -m specserve.launch_server [flags]`: parse flags, start the engine, serve HTTP.

With no flags it serves the embedded default model (SmolLM2-135M-Instruct) on CPU when
there is no GPU. Bad flags print one clear line and exit with status 2; a taken port or a
bad model, tokenizer or draft source exits with status 1 before any weights load
(`preflight.py`). SIGINT (Ctrl-C) and SIGTERM shut down the same way: the HTTP server
stops admitting, running requests get --graceful-shutdown-timeout seconds to finish (the
rest end with an abort, server/uvicorn_server.py), the engine processes are told to stop
and waited for, and the exit status is 0. An
engine process (or, with --nnodes, another host) that dies while serving stops the server
with one error line and exit status 1. With --node-rank > 0 this host runs its ranks
only (`follower_node.py`); node 0 serves HTTP.
"""
from __future__ import annotations

import logging
import signal
import socket
import sys
from contextlib import closing
from types import FrameType
from typing import TYPE_CHECKING, Any

from specserve.args import ConfigError, parse_config
from specserve.core.config import Config
from specserve.engine.process import setup_logging

if TYPE_CHECKING:
    from specserve.engine.client import ProcessEngineClient
    from specserve.engine.nodes import NodeWatch
    from specserve.frontends import FrontEnds

logger = logging.getLogger("specserve")


class _Terminated(Exception):
    """SIGTERM, raised in the main thread so that shutdown runs the same code as Ctrl-C."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_config(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.server.log_level)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _serve(cfg)
    except (KeyboardInterrupt, _Terminated):
        logger.info("Shut down")
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serve(cfg: Config) -> int:
    from specserve.engine.client import ProcessEngineClient
    from specserve.preflight import bind_port, resolve_sources

    if cfg.runner.node_rank > 0:
        from specserve.follower_node import serve_follower_node

        return serve_follower_node(cfg)
    try:
        sock = bind_port(cfg.server.host, cfg.server.port)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    stopper = _Stopper()
    with closing(sock):
        watch = _watch_nodes(cfg, stopper)
        try:
            client = ProcessEngineClient(*resolve_sources(cfg), on_death=stopper.stop)
        except (RuntimeError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            if watch is not None:
                watch.report(str(e))
            return 1
        fronts = None
        try:
            if cfg.server.tokenizer_worker_num > 1:
                from specserve.frontends import FrontEnds

                fronts = FrontEnds(client, client.tokenizer, sock, stopper.stop)
            _run_http(client, sock, stopper, fronts)
        finally:
            if fronts is not None:
                fronts.stop(cfg.server.graceful_shutdown_timeout)
            client.shutdown()
            if watch is not None:
                watch.close()
    if stopper.why is not None:
        why = stopper.why
        if watch is not None:
            why = _first_cause(watch, why)
            watch.report(why)
        print(f"error: {why}", file=sys.stderr)
        return 1
    return 0


def _first_cause(watch: NodeWatch, why: str) -> str:
    """`why` a rank here died, or another host's report of its own rank's death first when
    one comes (engine/nodes.py): rank 0 fails in a collective when any rank is gone."""
    if why.startswith("node "):  # the watch's own news: another host's report already
        return why
    remote = watch.remote_report()
    return why if remote is None else f"{remote}; then here: {why}"


class _Stopper:
    """Ends the HTTP server from another thread when an engine process or a host dies."""

    def __init__(self) -> None:
        self.why: str | None = None
        self.server: Any = None  # the uvicorn.Server, once it exists

    def stop(self, why: str) -> None:
        if self.why is None:
            self.why = why
        if self.server is not None:
            self.server.should_exit = True


def _watch_nodes(cfg: Config, stopper: _Stopper) -> NodeWatch | None:
    if cfg.runner.nnodes == 1:
        return None
    from specserve.engine.nodes import NodeWatch

    assert cfg.runner.dist_init_addr is not None  # args_parallel.py
    return NodeWatch(cfg.runner.dist_init_addr, cfg.runner.nnodes, 0, stopper.stop)


def _run_http(client: ProcessEngineClient, sock: socket.socket, stopper: _Stopper,
              fronts: FrontEnds | None) -> None:
    from specserve.server.uvicorn_server import draining_server

    cfg = client.config.server
    server = draining_server(client, also=fronts.terminate if fronts is not None else lambda: None)
    stopper.server = server
    if stopper.why is not None:  # an engine died before the server existed
        return
    logger.info("The server is fired up and ready to roll! http://%s:%d (model %s, context %d)",
                cfg.host, cfg.port, client.info.served_model_name, client.info.context_length)
    server.run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
