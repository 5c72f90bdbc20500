"""End-to-end: the server stops cleanly, whenever it is told to.

Ctrl-C in a terminal (SIGINT to the whole process group) after serving a request, and
SIGTERM to the server alone while its engine process is still loading the model: both exit
with status 0, print no traceback and leave no process of the server's session behind.
(Every other e2e server is stopped by SIGTERM with the same checks: server_utils.py.)
SIGTERM under load ends the running streams with a 503 once --graceful-shutdown-timeout
has passed, and exits with status 0 soon after. An engine that dies, or whose step hangs
past --watchdog-timeout, fails the running request and stops the server with status 1
and a line naming the cause, leaving no process behind.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.server_utils import (
    REPO,
    assert_stops_with_error,
    engine_pids,
    free_port,
    session_pids,
    stop_and_check,
    wait_healthy,
)

pytestmark = [pytest.mark.slow, pytest.mark.serial]


def _start(tmp_path, *flags: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "specserve.launch_server", "--port", str(port), *flags],
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


def _long_stream(url: str) -> tuple[threading.Thread, list[str]]:
    """A greedy /generate stream far longer than the test: its SSE lines land in the list."""
    lines: list[str] = []
    body = {"text": "Tell a long story.", "stream": True,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0}}

    def read() -> None:
        try:
            with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as r:
                lines.extend(line for line in r.iter_lines() if line)
        except httpx.HTTPError as exc:
            lines.append(f"transport error: {exc!r}")

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not lines and time.monotonic() < deadline:  # it has started generating
        time.sleep(0.1)
    assert lines, "the stream produced nothing"
    return thread, lines


def test_sigterm_under_load_ends_the_streams_within_the_grace_period(tmp_path):
    proc, url, log_path = _start(tmp_path, "--graceful-shutdown-timeout", "2")
    wait_healthy(proc, url, log_path)
    streams = [_long_stream(url) for _ in range(3)]
    stop_and_check(proc, log_path, signal.SIGTERM, within_s=2 + 20)
    for thread, lines in streams:
        thread.join(timeout=10)
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "shutting down" in error["message"], error


def test_a_dead_engine_fails_its_requests_and_stops_the_server(tmp_path):
    proc, url, log_path = _start(tmp_path)
    wait_healthy(proc, url, log_path)
    thread, lines = _long_stream(url)
    (engine,) = engine_pids(proc)
    os.kill(engine, signal.SIGKILL)
    assert_stops_with_error(proc, log_path, 15, "error: the engine process exited")
    thread.join(timeout=10)
    assert '"code": 503' in lines[-2] and lines[-1] == "data: [DONE]", lines[-3:]


def test_a_stuck_engine_step_stops_the_server(tmp_path):
    proc, url, log_path = _start(tmp_path, "--watchdog-timeout", "2")
    wait_healthy(proc, url, log_path)
    thread, lines = _long_stream(url)
    (engine,) = engine_pids(proc)
    os.kill(engine, signal.SIGSTOP)  # mid-step: it never ends (nor heeds SIGTERM)
    assert_stops_with_error(proc, log_path, 20, "error: the engine process has spent more than 2 s in one step (--watchdog-timeout)")
    thread.join(timeout=10)
    assert "watchdog" in lines[-2] and lines[-1] == "data: [DONE]", lines[-3:]
