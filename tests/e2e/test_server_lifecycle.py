"""End-to-end: the server stops cleanly, whenever it is told to.

Ctrl-C in a terminal (SIGINT to the whole process group) after serving a request, and
SIGTERM to the server alone while its engine process is still loading the model: both exit
with status 0, print no traceback and leave no process of the server's session behind.
(Every other e2e server is stopped by SIGTERM with the same checks: server_utils.py.)
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.server_utils import REPO, free_port, session_pids, stop_and_check, wait_healthy

pytestmark = pytest.mark.slow


def _start(tmp_path) -> tuple[subprocess.Popen, str, object]:
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "specserve.launch_server", "--port", str(port)],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", log_path


def test_ctrl_c_after_serving_stops_everything(tmp_path):
    proc, url, log_path = _start(tmp_path)
    wait_healthy(proc, url, log_path)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).status_code == 200
    stop_and_check(proc, log_path, signal.SIGINT, to_group=True)


def test_sigterm_while_the_engine_loads_stops_everything(tmp_path):
    proc, url, log_path = _start(tmp_path)
    deadline = time.monotonic() + 120
    while len(session_pids(proc.pid)) < 2:  # the engine process has been started
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.05)
    stop_and_check(proc, log_path, signal.SIGTERM)
