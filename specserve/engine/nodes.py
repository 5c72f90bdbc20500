"""The hosts of a multi-node tensor-parallel group watch each other.

Each host's launcher (not its engine processes) joins a TCPStore beside the ranks'
rendezvous, at --dist-init-addr's port + 1, hosted by node 0. Every HEARTBEAT_S each
writes its heartbeat and reads the others'; a host that stops beating for STALE_S
after its first beat, a "down" report (a host whose engine process died writes one), or
a store that no longer answers (node 0 is gone) is a failure: `on_failure` is called once
with what happened, and the launcher takes its own processes and server down. So a rank
that dies on any host ends every host within seconds, even where the other ranks sit in
a collective that would wait for it until NCCL's timeout.

A rank that dies on one host makes rank 0's next collective fail on node 0, often before
the dead rank's host has reported: node 0's launcher then asks for another host's report
(`remote_report`, up to REMOTE_WAIT_S) and names that first, its own rank's exit after.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

HEARTBEAT_S = 0.5
STALE_S = 10.0
CLOSE_WAIT_S = 5.0  # for the watch thread's last store call
REMOTE_WAIT_S = 2.0  # for another host's report when a rank here died (a follower reports within HEARTBEAT_S)


class NodeWatch:
    def __init__(self, addr: str, nnodes: int, node_rank: int, on_failure: Callable[[str], None]) -> None:
        from torch.distributed import TCPStore

        host, port = addr.rsplit(":", 1)
        self.node, self.nnodes, self.on_failure = node_rank, nnodes, on_failure
        self.store = TCPStore(host, int(port) + 1, nnodes, is_master=node_rank == 0,
                              timeout=timedelta(minutes=30), wait_for_workers=False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="node-watch")
        self._thread.start()

    def report(self, what: str) -> None:
        """Tell the other hosts this one is going down because of `what`."""
        try:
            self.store.set("down", f"node {self.node}: {what}")
        except Exception:  # noqa: BLE001 - the store may be gone already; nothing to tell
            pass

    def remote_report(self, wait_s: float = REMOTE_WAIT_S) -> str | None:
        """Another host's "down" report, waiting up to `wait_s` for one; None if none came
        (or the store is gone)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if self.store.check(["down"]):
                    what = self.store.get("down").decode()
                    if not what.startswith(f"node {self.node}:"):
                        return what
            except Exception:  # noqa: BLE001 - the store is gone: nobody else can report
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def close(self) -> None:
        """Stop watching, and wait for a store call in flight: a process that exits while
        the thread is inside one (node 0's store gone) is aborted by the store's C++ code."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=CLOSE_WAIT_S)

    def _run(self) -> None:
        beat, last, seen = 0, dict[int, bytes](), dict[int, float]()
        while not self._stop.wait(HEARTBEAT_S):
            try:
                beat += 1
                self.store.set(f"hb/{self.node}", str(beat))
                if self.store.check(["down"]):
                    return self._fail(self.store.get("down").decode())
                now = time.monotonic()
                for other in range(self.nnodes):
                    if other == self.node or not self.store.check([f"hb/{other}"]):
                        continue
                    value = self.store.get(f"hb/{other}")
                    if value != last.get(other):
                        last[other], seen[other] = value, now
                    elif now - seen[other] > STALE_S:
                        return self._fail(f"node {other} stopped answering for {STALE_S:.0f} s")
            except Exception as e:  # noqa: BLE001 - node 0's store gone: the group is over
                return self._fail(f"lost contact with node 0 ({type(e).__name__})")

    def _fail(self, what: str) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self.on_failure(what)
