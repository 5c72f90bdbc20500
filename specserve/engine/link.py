"""EngineLink: one front end's pipes to every engine replica.

Implements `engine.protocol.EngineClient` over a (to the engine, from the engine) pipe pair
per replica. It routes each request to one replica (`router.py`). A reader thread per
replica receives its messages and hands them to the asyncio loop (`call_soon_threadsafe`),
one queue per request; control questions go to every replica and their answers are merged
(`merge.py`). The launcher's front end is a `ProcessEngineClient` (client.py), which also
owns and watches the engine processes; each further front-end process
(--tokenizer-worker-num, `frontends.py`) holds a link of its own, to pipes of its own.

Request ids: a caller's rid is refused while a request with it is in flight
(`DuplicateRequestId`), and the engine is sent an id unique to this submission and this
front end, so no two requests ever share a stream. A pipe that closes ends every waiting
request with an abort (status 503) and `is_alive()` turns False.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from typing import Any

from specserve.core.config import Config
from specserve.core.messages import AbortReq, ControlOut, ControlReq, GenerateReq, TokenOut
from specserve.engine.merge import merge_metrics, merge_server_info
from specserve.engine.protocol import DuplicateRequestId, ModelInfo, ShuttingDown
from specserve.engine.router import Router
from specserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("specserve")


class EngineLink:
    def __init__(self, config: Config, tokenizer: Tokenizer, info: ModelInfo,
                 pipes: list[tuple[Connection, Connection]], front: int = 0,
                 on_death: Callable[[str], None] | None = None) -> None:
        """`pipes[d]`: (to, from) replica d's rank 0; `front`: this front end's number."""
        self.config, self.tokenizer, self.info, self.on_death = config, tokenizer, info, on_death
        self.front = front
        self._pipes = pipes
        self._closing = self._draining = False
        self.router = Router(len(pipes))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue] = {}  # by the id the engine sees
        self._in_flight: dict[str, str] = {}  # a caller's rid -> the id the engine sees
        self._submissions = itertools.count()
        self._controls: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count(1)
        self._alive = True
        self._lock = threading.Lock()
        for d in range(len(pipes)):
            threading.Thread(target=self._reader, args=(d,), daemon=True, name=f"engine-reader-{d}").start()

    # -- threads -------------------------------------------------------------------------
    def _reader(self, d: int) -> None:
        try:
            while True:
                msg = self._pipes[d][1].recv()
                self._call_in_loop(self._dispatch, msg)
        except (EOFError, OSError):
            pass
        self._pipe_closed(d)

    def _pipe_closed(self, d: int) -> None:
        self._died(f"replica {d}'s engine closed its pipe")

    def _died(self, what: str, grace_s: float = 5) -> None:
        with self._lock:
            if not self._alive:
                return
            self._alive = False
        if self._closing:
            return
        logger.error("%s: stopping the server", what)
        self._call_in_loop(self._fail_all, what)
        self._after_death(grace_s)
        if self.on_death is not None:
            self.on_death(what)

    def _after_death(self, grace_s: float) -> None:
        """What else a death stops (the process owner's: the engine processes)."""

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
        for row in msg:  # TokenOut.packed tuples; row[0] is the id the engine was sent
            q = self._queues.get(row[0])
            if q is not None:
                q.put_nowait(TokenOut.unpacked(row))

    def _fail_all(self, what: str) -> None:
        self._end_all({"type": "abort", "status_code": 503, "message": f"the engine stopped: {what}"})
        for fut in self._controls.values():
            if not fut.done():
                fut.set_exception(RuntimeError(f"the engine stopped: {what}"))

    def _end_all(self, reason: dict[str, Any]) -> None:
        """Finish every waiting request's stream with `reason` (on the event loop)."""
        for rid, q in self._queues.items():
            q.put_nowait(TokenOut(rid, [], "", True, dict(reason)))

    # -- shutdown ----------------------------------------------------------------------
    def begin_shutdown(self, grace_s: float) -> None:
        """Admit nothing new (ShuttingDown: a 503); requests still running `grace_s` seconds
        from now end with an abort (status 503) and are aborted in the engine. Call it on
        the event loop."""
        self._draining = True
        if self._loop is not None and self._queues:
            self._loop.call_later(grace_s, self._abort_running)

    def _abort_running(self) -> None:
        rids = list(self._queues)
        self._end_all({"type": "abort", "status_code": 503,
                       "message": "the server is shutting down: the request was stopped before it finished"})
        if self._alive:
            for d in range(len(self._pipes)):
                for rid in rids:
                    self._send(d, AbortReq(rid))

    def shutdown(self) -> None:
        """This front end is done: a closing pipe is no longer news."""
        self._closing = True

    # -- EngineClient protocol ---------------------------------------------------------
    def _send(self, d: int, msg: Any) -> None:
        if not self._alive:
            raise RuntimeError("the engine process is not running")
        self._pipes[d][0].send(msg)

    async def generate(self, req: GenerateReq) -> AsyncIterator[TokenOut]:
        if len(req.input_ids) >= self.info.context_length:
            raise ValueError(f"the prompt has {len(req.input_ids)} tokens, the context length is "
                             f"{self.info.context_length}")
        req.params.validate(self.info.vocab_size)
        if self._draining:
            raise ShuttingDown("the server is shutting down and admits no new requests")
        if req.rid in self._in_flight:  # checked and claimed with no await between: atomic on the loop
            raise DuplicateRequestId(f"a request with rid {req.rid!r} is already in flight")
        self._loop = asyncio.get_running_loop()
        # The engine sees an id unique to this submission and front end: outputs of an earlier
        # request with the same rid, still in the pipe after its abort, find no queue.
        sent = dataclasses.replace(req, rid=f"{req.rid}#{self.front}.{next(self._submissions)}")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[sent.rid], self._in_flight[req.rid] = queue, sent.rid
        d = self.router.pick(req.input_ids)
        finished = False
        try:
            self._send(d, sent)
            while not finished:
                out = await queue.get()
                finished = out.finished
                out.rid = req.rid  # this stream's own object (unpacked for it alone)
                yield out
        finally:
            self.router.done(d)
            self._queues.pop(sent.rid, None)
            self._in_flight.pop(req.rid, None)
            if not finished and self._alive:
                self._pipes[d][0].send(AbortReq(sent.rid))

    async def abort(self, rid: str) -> None:
        sent = self._in_flight.get(rid)
        if self._alive and sent is not None:
            for d in range(len(self._pipes)):
                self._send(d, AbortReq(sent))

    async def control(self, op: str) -> Any:
        """Ask every replica; one replica's answer as it is, several merged."""
        self._loop = asyncio.get_running_loop()
        futs = []
        for d in range(len(self._pipes)):
            token = next(self._tokens)
            fut = self._loop.create_future()
            self._controls[token] = fut
            self._send(d, ControlReq(op, token))
            futs.append(fut)
        results = await asyncio.wait_for(asyncio.gather(*futs), timeout=60)
        if op == "server_info":  # which front end answered (--tokenizer-worker-num)
            info = results[0] if len(results) == 1 else merge_server_info(results, self.router.routed)
            return {**info, "front_end": self.front} if isinstance(info, dict) else info
        if len(results) == 1:
            return results[0]
        if op == "flush_cache":
            return all(results)
        return merge_metrics(results)

    def is_alive(self) -> bool:
        return self._alive
