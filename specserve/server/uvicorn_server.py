"""uvicorn's server with a bounded, graceful shutdown.

On SIGTERM or Ctrl-C uvicorn stops accepting connections and then waits for the running
responses, for as long as they take. `DrainingServer` first calls `begin_shutdown(grace)`
(the engine client's: admit nothing new, and abort what still runs `grace` seconds later,
so those responses end with an abort instead of being cut), and bounds uvicorn's wait
to the grace period plus SLACK_S, after which uvicorn cancels what is left.
"""
from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any

import uvicorn

logger = logging.getLogger("specserve")
SLACK_S = 5.0  # for the aborted responses to be written out


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, begin_shutdown: Callable[[float], None], grace_s: float) -> None:
        config.timeout_graceful_shutdown = int(grace_s + SLACK_S)
        super().__init__(config)
        self.begin_shutdown, self.grace_s = begin_shutdown, grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        logger.info("Shutting down: running requests have %g s to finish", self.grace_s)
        self.begin_shutdown(self.grace_s)
        await super().shutdown(sockets)


def draining_server(client: Any, also: Callable[[], None] = lambda: None) -> DrainingServer:
    """The HTTP server of one front end over `client` (an EngineClient with
    `begin_shutdown`), configured from its config's server section; `also()` runs when
    its shutdown begins."""
    from specserve.server.http import build_app

    def begin_shutdown(grace_s: float) -> None:
        client.begin_shutdown(grace_s)
        also()

    cfg = client.config.server
    return DrainingServer(uvicorn.Config(
        build_app(client), log_level=cfg.log_level if cfg.log_level != "info" else "warning",
        timeout_keep_alive=5), begin_shutdown, cfg.graceful_shutdown_timeout)
