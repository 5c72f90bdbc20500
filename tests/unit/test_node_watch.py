"""Hosts of a multi-node group watch each other (engine/nodes.py): a host's "down" report
reaches the others, and node 0 can wait for another host's report to name the first cause
when its own rank fails in a collective (launch_server.py `_first_cause`)."""
from __future__ import annotations

import socket
import time

from specserve.engine.nodes import NodeWatch
from specserve.launch_server import _first_cause


def _addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"127.0.0.1:{port - 1}"  # the watch's store sits at the rendezvous port + 1


def test_another_hosts_report_is_named_first():
    heard: list[str] = []
    addr = _addr()
    node0 = NodeWatch(addr, 2, 0, heard.append)
    node1 = NodeWatch(addr, 2, 1, heard.append)
    try:
        start = time.monotonic()
        assert node0.remote_report(0.3) is None and time.monotonic() - start >= 0.3  # nobody reported
        assert _first_cause(node0, "node 1 stopped answering for 10 s") == "node 1 stopped answering for 10 s"
        node0.report("tensor-parallel rank 0 exited (code 1)")
        assert node0.remote_report(0.2) is None  # its own report is no other host's
        node1.report("tensor-parallel rank 1 exited (code -9)")
        assert node0.remote_report(1.0) == "node 1: tensor-parallel rank 1 exited (code -9)"
        assert _first_cause(node0, "tensor-parallel rank 0 exited (code 1)") == (
            "node 1: tensor-parallel rank 1 exited (code -9); then here: tensor-parallel rank 0 exited (code 1)")
    finally:
        node1.close()
        node0.close()
