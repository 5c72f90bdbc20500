"""ProcessEngineClient: the HTTP process's handle on the engine process.

Implements `engine.protocol.EngineClient`. A reader thread receives the engine's
messages and hands them to the asyncio loop (`call_soon_threadsafe`), one queue per
request; control questions are futures keyed by a token. If the engine process dies,
every waiting request ends with an abort and `is_alive()` turns False.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from specserve.core.messages import AbortReq, ControlOut, ControlReq, GenerateReq, TokenOut
from specserve.engine.process import engine_main
from specserve.engine.protocol import EngineStart, ModelInfo
from specserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("specserve")
START_TIMEOUT_S = 1800.0


class ProcessEngineClient:
    def __init__(self, start: EngineStart, tokenizer: Tokenizer) -> None:
        """Start the engine process on what start-up resolved (preflight.py) and wait
        until it serves; RuntimeError if it fails to start."""
        self.config, self.tokenizer = start.config, tokenizer
        ctx = mp.get_context("spawn")
        inbox_r, self._inbox = ctx.Pipe(duplex=False)
        self._outbox, outbox_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=engine_main, args=(start, inbox_r, outbox_w),
                                 daemon=True, name="specserve-engine")
        self._proc.start()
        inbox_r.close()
        outbox_w.close()
        self._closing = False
        try:
            self.info: ModelInfo = self._wait_ready()
        except BaseException:  # a failed start, or Ctrl-C / SIGTERM while loading: no orphan
            self._stop_process(grace_s=0)
            raise
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._controls: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count(1)
        self._alive = True
        threading.Thread(target=self._reader, daemon=True, name="engine-reader").start()

    def _wait_ready(self) -> ModelInfo:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._outbox.poll(0.5):
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine process exited during start-up (code {self._proc.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError("the engine process did not start in time")
        kind, payload = self._outbox.recv()
        if kind == "error":
            raise RuntimeError(f"the engine failed to start: {payload}")
        return payload

    # -- reader thread -------------------------------------------------------------------
    def _reader(self) -> None:
        try:
            while True:
                msg = self._outbox.recv()
                self._call_in_loop(self._dispatch, msg)
        except (EOFError, OSError):
            pass
        self._alive = False
        if not self._closing:
            logger.error("the engine process exited (code %s)", self._proc.exitcode)
        self._call_in_loop(self._fail_all)

    def _call_in_loop(self, fn: Any, *args: Any) -> None:
        """Run fn(*args) on the HTTP event loop, unless it is gone (shutdown)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # closed between the check and the call
            pass

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, ControlOut):
            fut = self._controls.pop(msg.token, None)
            if fut is not None and not fut.done():
                fut.set_result(msg.result)
            return
        for out in msg:
            q = self._queues.get(out.rid)
            if q is not None:
                q.put_nowait(out)

    def _fail_all(self) -> None:
        for rid, q in self._queues.items():
            q.put_nowait(TokenOut(rid, [], "", True, {"type": "abort", "message": "the engine process died"}))
        for fut in self._controls.values():
            if not fut.done():
                fut.set_exception(RuntimeError("the engine process died"))

    # -- EngineClient protocol ---------------------------------------------------------
    def _send(self, msg: Any) -> None:
        if not self._alive:
            raise RuntimeError("the engine process is not running")
        self._inbox.send(msg)

    async def generate(self, req: GenerateReq) -> AsyncIterator[TokenOut]:
        if len(req.input_ids) >= self.info.context_length:
            raise ValueError(f"the prompt has {len(req.input_ids)} tokens, the context length is "
                             f"{self.info.context_length}")
        req.params.validate(self.info.vocab_size)
        self._loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[req.rid] = queue
        finished = False
        try:
            self._send(req)
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            self._queues.pop(req.rid, None)
            if not finished and self._alive:
                self._inbox.send(AbortReq(req.rid))

    async def abort(self, rid: str) -> None:
        if self._alive:
            self._inbox.send(AbortReq(rid))

    async def control(self, op: str) -> Any:
        self._loop = asyncio.get_running_loop()
        token = next(self._tokens)
        fut = self._loop.create_future()
        self._controls[token] = fut
        self._send(ControlReq(op, token))
        return await asyncio.wait_for(fut, timeout=60)

    def is_alive(self) -> bool:
        return self._alive and self._proc.is_alive()

    def shutdown(self) -> None:
        """Stop the engine process and wait for it (at most ~10 s)."""
        self._closing = True
        try:
            self._inbox.send(None)
        except (OSError, BrokenPipeError):
            pass
        self._stop_process()

    def _stop_process(self, grace_s: float = 5) -> None:
        """Wait `grace_s` for the engine process to exit, then terminate it, then kill it."""
        self._closing = True
        self._proc.join(timeout=grace_s)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=3)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
