"""The engine's own process: receive requests, step the scheduler, send deltas back.

The HTTP server's event loop and the scheduler's hot loop must not share one GIL, so
the scheduler runs here. Messages are the dataclasses of `messages.py` over two
one-way multiprocessing pipes. A step that raises aborts the requests it touched (with
the error) instead of killing the process: no client can crash the server.
"""
from __future__ import annotations

import logging
import signal
import traceback
from multiprocessing.connection import Connection

from specserve.core.messages import AbortReq, ControlOut, ControlReq, GenerateReq
from specserve.engine.protocol import EngineStart, ModelInfo

logger = logging.getLogger("specserve")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")


def engine_main(start: EngineStart, inbox: Connection, outbox: Connection) -> None:
    # Ctrl-C reaches the whole process group; the front end decides when this process stops
    # (it sends None, then waits), so SIGINT here would only print a second traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cfg = start.config
    setup_logging(cfg.server.log_level)
    try:
        from specserve.engine.scheduler import Scheduler
        from specserve.tokenizer.tokenizer import load_tokenizer

        sched = Scheduler(start, load_tokenizer(start.tokenizer_dir))
    except Exception as e:  # report, don't hang the parent
        outbox.send(("error", f"{type(e).__name__}: {e}"))
        return
    served = cfg.model.served_model_name or cfg.model.model_path
    try:
        outbox.send(("ready", ModelInfo(served, sched.context_length, sched.runner.vocab_size,
                                        sched.max_running, sched.kv.num_slots)))
        _loop(sched, inbox, outbox)
    except (BrokenPipeError, EOFError, OSError):
        return  # the front end went away: nothing left to serve


def _loop(sched, inbox: Connection, outbox: Connection) -> None:
    while True:
        outs = []
        timeout = 0.0 if sched.has_work else 0.05
        try:
            while inbox.poll(timeout):
                msg = inbox.recv()
                if msg is None:
                    return
                outs += _handle(sched, msg, outbox)
                timeout = 0.0
        except (EOFError, OSError):
            return  # the front end is gone
        if sched.has_work:
            outs += _safe_step(sched)
        if outs:
            outbox.send(outs)


def _handle(sched, msg, outbox: Connection) -> list:
    if isinstance(msg, GenerateReq):
        return sched.add_request(msg)
    if isinstance(msg, AbortReq):
        return sched.abort(msg.rid)
    if isinstance(msg, ControlReq):
        ops = {"flush_cache": sched.flush_cache, "server_info": sched.server_info, "metrics": sched.metrics}
        result = ops[msg.op]() if msg.op in ops else {"error": f"unknown control op {msg.op}"}
        outbox.send(ControlOut(msg.token, result))
    return []


def _safe_step(sched) -> list:
    try:
        return sched.step()
    except Exception as e:
        logger.error("step failed, aborting its requests:\n%s", traceback.format_exc())
        outs = []
        for req in list(sched.waiting) + sched.prefilling + sched.running:
            outs += sched.abort(req.rid)
        for out in outs:
            out.finish_reason = {"type": "abort", "message": f"internal error: {type(e).__name__}: {e}"}
        return outs
