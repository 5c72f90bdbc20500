"""`python -m specserve.launch_server [flags]`: parse flags, start the engine, serve HTTP.

With no flags it serves the embedded default model (SmolLM2-135M-Instruct) on CPU when
there is no GPU. Bad flags print one clear line and exit with status 2.
"""
from __future__ import annotations

import logging
import sys

from specserve.args import ConfigError, parse_config
from specserve.engine.process import setup_logging

logger = logging.getLogger("specserve")


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_config(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup_logging(cfg.server.log_level)
    import uvicorn

    from specserve.engine.client import ProcessEngineClient
    from specserve.server.http import build_app

    try:
        client = ProcessEngineClient(cfg)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    app = build_app(client)
    logger.info("The server is fired up and ready to roll! http://%s:%d (model %s, context %d)",
                cfg.server.host, cfg.server.port, client.info.served_model_name, client.info.context_length)
    try:
        uvicorn.run(app, host=cfg.server.host, port=cfg.server.port,
                    log_level=cfg.server.log_level if cfg.server.log_level != "info" else "warning",
                    timeout_keep_alive=5)
    finally:
        client.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
