"""Start the real server as a subprocess on a free port and wait until /health answers.

Every server started here is stopped with SIGTERM at the end and must exit with status 0,
print no traceback, and leave no process of its session behind (the engine process included).
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port p such that p and p + 1 are both free now."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


@contextlib.contextmanager
def launched_server(extra_args: list[str], log_path: Path, preload: str | None = None) -> Iterator[str]:
    """The server on a free port until the block ends; `preload`: a module imported first
    (a plug-in that registers itself, e.g. a speculative algorithm)."""
    port = free_port()
    start = ["-m", "specserve.launch_server"] if preload is None else [
        "-c", f"import runpy, {preload}; runpy.run_module('specserve.launch_server', run_name='__main__')"]
    cmd = [sys.executable, *start, "--port", str(port), "--log-level", "warning", "--enable-metrics"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd + extra_args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log_path)
        yield url
    finally:
        stop_and_check(proc, log_path, signal.SIGTERM)


def session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (zombies whose parent is gone are not counted)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid, _pgrp, session = f.read().rsplit(")", 1)[1].split()[:4]
        except OSError:
            continue
        if int(session) == sid and not (state == "Z" and int(ppid) == 1):
            pids.append(int(entry))
    return pids


def stop_and_check(proc: subprocess.Popen, log_path: Path, sig: int, to_group: bool = False,
                   within_s: float = 60) -> None:
    """Send `sig` to the server (or, as a terminal's Ctrl-C does, to its whole process
    group) and check a clean exit within `within_s`: status 0, no traceback, no process of
    its session left."""
    sid = proc.pid  # start_new_session: the server leads its session and process group
    if to_group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    try:
        code = proc.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        os.killpg(sid, signal.SIGKILL)
        proc.wait(timeout=30)
        pytest.fail(f"the server did not exit within {within_s} s of {signal.Signals(sig).name}")
    deadline = time.monotonic() + 10
    while session_pids(sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = session_pids(sid)
    if left:
        os.killpg(sid, signal.SIGKILL)
    log = log_path.read_text(errors="replace")
    assert not left, f"processes left after {signal.Signals(sig).name}: {left}"
    assert code == 0, f"the server exited with {code} after {signal.Signals(sig).name}:\n{log[-3000:]}"
    assert "Traceback" not in log, log[-3000:]


def wait_healthy(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text(errors='replace')[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{log_path.read_text(errors='replace')[-4000:]}")


def engine_pids(proc: subprocess.Popen) -> list[int]:
    """The server's engine processes (multiprocessing's spawned children)."""
    return [p for p in session_pids(proc.pid) if p != proc.pid and _is_engine(p)]


def _is_engine(pid: int) -> bool:
    try:
        return "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


def assert_stops_with_error(proc: subprocess.Popen, log: Path, within_s: float, names: str) -> None:
    try:
        code = proc.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running {within_s} s later:\n{log.read_text()[-3000:]}")
    text = log.read_text(errors="replace")
    assert code == 1 and names in text, text[-3000:]
    assert_session_empties(proc)


def assert_session_empties(proc: subprocess.Popen) -> None:
    """No process of its session is left within 10 s (its resource tracker exits after it)."""
    deadline = time.monotonic() + 10
    while session_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not session_pids(proc.pid)
