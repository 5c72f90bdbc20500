"""`--node-rank > 0`: a host that runs its share of a multi-node tensor-parallel group and
serves no HTTP (node 0 does).

It resolves the same sources as node 0 (preflight.py, no port), starts its ranks
(engine/ranks.py), joins the hosts' watch (engine/nodes.py) and waits. It ends with status
0 when its ranks end cleanly (node 0 stopped them), and with one error line and status 1
when one of its ranks dies or outlasts --watchdog-timeout in a step (after telling the
other hosts) or another host fails. Ctrl-C
or SIGTERM stops its ranks.
"""
from __future__ import annotations

import logging
import sys
import threading
import time

from specserve.core.config import Config

logger = logging.getLogger("specserve")


def serve_follower_node(cfg: Config) -> int:
    from specserve.engine.client import on_gpu
    from specserve.engine.nodes import NodeWatch
    from specserve.engine.ranks import Layout, Replica
    from specserve.preflight import resolve_sources

    r = cfg.runner
    try:
        start, _ = resolve_sources(cfg)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    failed = threading.Event()
    why: list[str] = []
    assert r.dist_init_addr is not None  # args_parallel.py

    def on_failure(what: str) -> None:
        why.append(what)
        failed.set()

    layout = Layout.of(cfg, on_gpu(cfg))
    try:
        layout.check_gpus(1)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    watch = NodeWatch(r.dist_init_addr, r.nnodes, r.node_rank, on_failure)
    replica = Replica(start, layout.places(0))
    logger.info("Node %d runs tensor-parallel ranks %s", r.node_rank, [p.rank for p in replica.places])
    try:
        return _wait(replica, watch, failed, why, cfg.server.watchdog_timeout)
    finally:
        replica.stop(grace_s=2)
        watch.close()


def _wait(replica, watch, failed: threading.Event, why: list[str], watchdog_s: float) -> int:
    while not failed.wait(0.5):
        codes = [p.exitcode for p in replica.procs]
        if all(c == 0 for c in codes):
            return 0  # node 0 stopped the group
        stuck = replica.stuck(watchdog_s)
        if stuck is not None or any(c not in (None, 0) for c in codes):
            dead = stuck or replica.dead() or "a rank exited"
            watch.report(dead)
            print(f"error: {dead}", file=sys.stderr)
            return 1
    deadline = time.monotonic() + 2  # a clean stop at node 0 also ends its store: wait for our ranks
    while time.monotonic() < deadline:
        if all(p.exitcode == 0 for p in replica.procs):
            return 0
        time.sleep(0.1)
    print(f"error: {why[0]}", file=sys.stderr)
    return 1
