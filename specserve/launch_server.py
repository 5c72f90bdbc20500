"""`python -m specserve.launch_server [flags]`: parse flags, start the engine, serve HTTP.

With no flags it serves the embedded default model (SmolLM2-135M-Instruct) on CPU when
there is no GPU. Bad flags print one clear line and exit with status 2; a taken port or a
bad model, tokenizer or draft source exits with status 1 before any weights load
(`preflight.py`). SIGINT (Ctrl-C) and SIGTERM shut down the same way: the HTTP server
stops, the engine process is told to stop and waited for, and the exit status is 0.
"""
from __future__ import annotations

import logging
import signal
import socket
import sys
from contextlib import closing
from types import FrameType
from typing import TYPE_CHECKING

from specserve.args import ConfigError, parse_config
from specserve.core.config import Config
from specserve.engine.process import setup_logging

if TYPE_CHECKING:
    from specserve.engine.client import ProcessEngineClient

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

    try:
        sock = bind_port(cfg.server.host, cfg.server.port)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    with closing(sock):
        try:
            client = ProcessEngineClient(*resolve_sources(cfg))
        except (RuntimeError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        try:
            _run_http(client, sock)
        finally:
            client.shutdown()
    return 0


def _run_http(client: ProcessEngineClient, sock: socket.socket) -> None:
    import uvicorn

    from specserve.server.http import build_app

    cfg = client.config.server
    server = uvicorn.Server(uvicorn.Config(
        build_app(client), log_level=cfg.log_level if cfg.log_level != "info" else "warning",
        timeout_keep_alive=5))
    logger.info("The server is fired up and ready to roll! http://%s:%d (model %s, context %d)",
                cfg.host, cfg.port, client.info.served_model_name, client.info.context_length)
    server.run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
