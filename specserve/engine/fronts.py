"""Rank 0's pipes to the front ends: one pair per HTTP process (--tokenizer-worker-num).

`Fronts.read` takes whatever the front ends sent, tagged with who sent it; `send` hands
each delta back to the front end whose request it belongs to (a `GenerateReq`'s sender
owns its rid until the finished delta), as `TokenOut.packed` tuples, one message a front
end a step. Front end 0 is the launcher's: its `None`, or its pipe closing, stops the
engine. Any other front end whose pipe closes is gone: its running requests are aborted
(as if it had sent the aborts, so every rank sees the same messages) and the engine serves
on for the rest; the launcher, which watches that process, decides whether the server
stops.
"""
from __future__ import annotations

from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, cast

from specserve.core.messages import AbortReq, GenerateReq, TokenOut


class Fronts:
    def __init__(self, inboxes: list[Connection], outboxes: list[Connection]) -> None:
        self.inboxes, self.outboxes = inboxes, outboxes
        self.open = set(range(len(inboxes)))
        self.owner: dict[str, int] = {}  # rid the engine was sent -> its front end

    def read(self, timeout: float) -> list[tuple[int, Any]]:
        """(front end, message) pairs: every message waiting, after up to `timeout` seconds
        for the first. A `None` message (stop) ends the list."""
        msgs: list[tuple[int, Any]] = []
        for conn in cast(list[Connection], wait([self.inboxes[k] for k in sorted(self.open)], timeout)):
            front = self.inboxes.index(conn)
            try:
                while conn.poll(0):
                    msg = conn.recv()
                    if isinstance(msg, GenerateReq):
                        self.owner[msg.rid] = front
                    msgs.append((front, msg))
                    if msg is None:
                        return msgs
            except (EOFError, OSError):
                msgs += self._closed(front)
                if front == 0:
                    return msgs
        return msgs

    def _closed(self, front: int) -> list[tuple[int, Any]]:
        if front == 0:
            return [(0, None)]  # the launcher is gone: stop (the other ranks too)
        self.open.discard(front)
        return [(front, AbortReq(rid)) for rid, f in list(self.owner.items()) if f == front]

    def send(self, outs: list[TokenOut]) -> None:
        """Each delta to its request's front end."""
        by_front: dict[int, list[tuple]] = {}
        for out in outs:
            front = self.owner.pop(out.rid, 0) if out.finished else self.owner.get(out.rid, 0)
            by_front.setdefault(front, []).append(out.packed())
        for front, rows in by_front.items():
            self.reply(front, rows)

    def answer_to(self, front: int) -> Callable[[Any], None]:
        return lambda msg: self.reply(front, msg)

    def reply(self, front: int, msg: Any) -> None:
        """Send `msg` to one front end; one that has gone (not the launcher's) is skipped."""
        if front not in self.open:
            return
        try:
            self.outboxes[front].send(msg)
        except (BrokenPipeError, OSError):
            if front == 0:
                raise
            self.open.discard(front)
