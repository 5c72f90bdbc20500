"""ProcessEngineClient: the HTTP process's handle on the engine replicas.

Implements `engine.protocol.EngineClient`. It starts `--dp-size` replicas (each
`--tp-size` processes, engine/ranks.py) and routes each request to one (`router.py`).
A reader thread per replica receives its messages and hands them to the asyncio loop
(`call_soon_threadsafe`), one queue per request; control questions go to every replica
and their answers are merged (`merge.py`). A watcher thread waits on every engine
process (and, every WATCH_POLL_S, the step watchdog's clocks): if one exits, or stays in
one step longer than --watchdog-timeout, while serving, every waiting request ends with an abort,
`is_alive()` turns False, the other processes are stopped and `on_death` (the launcher's:
stop the server with an error) is called with what happened.

Request ids: a caller's rid is refused while a request with it is in flight
(`DuplicateRequestId`), and the engine is sent a submission-unique id, so no two requests
ever share a stream.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import wait
from typing import Any

from specserve.core.messages import AbortReq, ControlOut, ControlReq, GenerateReq, TokenOut
from specserve.engine.merge import merge_metrics, merge_model_info, merge_server_info
from specserve.engine.protocol import DuplicateRequestId, EngineStart, ModelInfo, ShuttingDown
from specserve.engine.ranks import Layout, Replica
from specserve.engine.router import Router
from specserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("specserve")
WATCH_POLL_S = 1.0


class ProcessEngineClient:
    def __init__(self, start: EngineStart, tokenizer: Tokenizer,
                 on_death: Callable[[str], None] | None = None) -> None:
        """Start the engine replicas on what start-up resolved (preflight.py) and wait
        until they serve; RuntimeError if one fails to start."""
        self.config, self.tokenizer, self.on_death = start.config, tokenizer, on_death
        layout = Layout.of(self.config, on_gpu(self.config))
        layout.check_gpus(self.config.runner.dp_size)
        self._closing = self._draining = False
        self._replicas: list[Replica] = []
        try:
            for d in range(self.config.runner.dp_size):  # all load at once
                self._replicas.append(Replica(start, layout.places(d), d))
            infos = [r.wait_ready() for r in self._replicas]
        except BaseException:  # a failed start, or Ctrl-C / SIGTERM while loading: no orphan
            self._stop_all(grace_s=0)
            raise
        self.info: ModelInfo = merge_model_info(infos)
        self.router = Router(len(self._replicas))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue] = {}  # by the id the engine sees
        self._in_flight: dict[str, str] = {}  # a caller's rid -> the id the engine sees
        self._submissions = itertools.count()
        self._controls: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count(1)
        self._alive = True
        self._lock = threading.Lock()
        for r in self._replicas:
            threading.Thread(target=self._reader, args=(r,), daemon=True, name=f"engine-reader-{r.index}").start()
        threading.Thread(target=self._watch, daemon=True, name="engine-watch").start()

    # -- threads -------------------------------------------------------------------------
    def _reader(self, replica: Replica) -> None:
        assert replica.outbox is not None
        try:
            while True:
                msg = replica.outbox.recv()
                self._call_in_loop(self._dispatch, msg)
        except (EOFError, OSError):
            pass
        replica.procs[0].join(timeout=2)  # reaped, its exit code says how it ended
        self._died(replica.dead() or f"replica {replica.index}'s engine closed its pipe")

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

    def _died(self, what: str, grace_s: float = 5) -> None:
        with self._lock:
            if not self._alive:
                return
            self._alive = False
        if self._closing:
            return
        logger.error("%s: stopping the server", what)
        self._call_in_loop(self._fail_all, what)
        threading.Thread(target=self._stop_all, args=(grace_s,), daemon=True, name="engine-stop").start()
        if self.on_death is not None:
            self.on_death(what)

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
            for r in self._replicas:
                for rid in rids:
                    self._send(r, AbortReq(rid))

    # -- EngineClient protocol ---------------------------------------------------------
    def _send(self, replica: Replica, msg: Any) -> None:
        if not self._alive or replica.inbox is None:
            raise RuntimeError("the engine process is not running")
        replica.inbox.send(msg)

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
        # The engine sees a submission-unique id: outputs of an earlier request with the same
        # rid, still in the pipe after its abort, find no queue instead of this request's.
        sent = dataclasses.replace(req, rid=f"{req.rid}#{next(self._submissions)}")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[sent.rid], self._in_flight[req.rid] = queue, sent.rid
        d = self.router.pick(req.input_ids)
        replica = self._replicas[d]
        finished = False
        try:
            self._send(replica, sent)
            while not finished:
                out = await queue.get()
                finished = out.finished
                out.rid = req.rid  # this stream's own object (unpacked for it alone)
                yield out
        finally:
            self.router.done(d)
            self._queues.pop(sent.rid, None)
            self._in_flight.pop(req.rid, None)
            if not finished and self._alive and replica.inbox is not None:
                replica.inbox.send(AbortReq(sent.rid))

    async def abort(self, rid: str) -> None:
        sent = self._in_flight.get(rid)
        if self._alive and sent is not None:
            for r in self._replicas:
                self._send(r, AbortReq(sent))

    async def control(self, op: str) -> Any:
        """Ask every replica; one replica's answer as it is, several merged."""
        self._loop = asyncio.get_running_loop()
        futs = []
        for r in self._replicas:
            token = next(self._tokens)
            fut = self._loop.create_future()
            self._controls[token] = fut
            self._send(r, ControlReq(op, token))
            futs.append(fut)
        results = await asyncio.wait_for(asyncio.gather(*futs), timeout=60)
        if len(results) == 1:
            return results[0]
        if op == "flush_cache":
            return all(results)
        if op == "server_info":
            return merge_server_info(results, self.router.routed)
        return merge_metrics(results)

    def is_alive(self) -> bool:
        return self._alive and all(r.dead() is None for r in self._replicas)

    def shutdown(self) -> None:
        """Stop every engine process and wait for them (at most ~10 s)."""
        self._closing = True
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
