"""The server a soak runs against: started in its own session, read through /proc and
/metrics, and stopped without leaving a process behind.

Owns the server's processes: `SoakServer` launches `python -m specserve.launch_server` on a
free port with `--enable-metrics` (plus the caller's flags) as the leader of a new session;
`stop` sends SIGTERM and SIGKILLs whatever of that session is still alive after a grace
period, so the bench leaves nothing behind however it fails; and should the bench itself be
killed outright (SIGKILL: no `finally` runs), the kernel sends the server SIGTERM
(PR_SET_PDEATHSIG), which stops it and its engine. Memory is read from
/proc/<pid>/status for the server and each of its descendants (engine processes,
multiprocessing's helpers): VmRSS, and of it RssShmem, the shared pages. On the CPU the KV
pool is shared anonymous memory whose pages are touched on first use (cache/kv_pool.py
`_zeros`), so its growth is KV slots used for the first time, bounded by the pool's size;
`Memory.private_mb` leaves it out. It knows nothing about the load.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

STOP_GRACE_S = 60.0
# The gauges of the scheduler's metrics() (engine/scheduler.py), as /metrics names them.
RUNNING, QUEUED, TOKEN_USAGE = "specserve:num_running_reqs", "specserve:num_queue_reqs", "specserve:token_usage"


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _term_with_parent() -> None:
    """In the child before exec: SIGTERM when the bench's (main) thread dies."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_stat(text: str) -> tuple[str, int, int]:
    """(state, ppid, session) from /proc/<pid>/stat; the command name may hold spaces and ')'."""
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[3])


def parse_status_kb(status: str, name: str) -> int | None:
    """A "<name>: <n> kB" field of /proc/<pid>/status (the memory ones are absent for a zombie)."""
    for line in status.splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    return None


@dataclass(frozen=True)
class Memory:
    """One process's resident memory, MiB."""

    rss_mb: float  # VmRSS
    shmem_mb: float  # RssShmem, part of VmRSS: on the CPU, the KV pool's touched pages

    @property
    def private_mb(self) -> float:
        return self.rss_mb - self.shmem_mb


def _read(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _live_stats() -> dict[int, tuple[str, int, int]]:
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (text := _read(f"/proc/{entry}/stat")) is not None:
            stats[int(entry)] = parse_stat(text)
    return stats


def descendants(root: int, parents: dict[int, int]) -> list[int]:
    """`root` and every process below it, given pid -> ppid, parents before children."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    order, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        order.append(pid)
        todo.extend(sorted(children.get(pid, [])))
    return order


def role(pid: int, root: int) -> str:
    """A short name: http (the server), engine (a spawned child), or the process's comm."""
    if pid == root:
        return "http"
    cmdline = (_read(f"/proc/{pid}/cmdline") or "").replace("\0", " ")
    if "resource_tracker" in cmdline:
        return "resource_tracker"
    if "spawn_main" in cmdline:
        return "engine"
    return (_read(f"/proc/{pid}/comm") or "?").strip()


def tree_memory(root: int) -> dict[str, Memory]:
    """The memory of `root` and its live descendants, keyed "<role> <pid>"."""
    parents = {pid: ppid for pid, (_, ppid, _) in _live_stats().items()}
    if root not in parents:
        return {}
    out = {}
    for pid in descendants(root, parents):
        status = _read(f"/proc/{pid}/status") or ""
        rss, shmem = parse_status_kb(status, "VmRSS"), parse_status_kb(status, "RssShmem")
        if rss is not None:
            out[f"{role(pid, root)} {pid}"] = Memory(rss / 1024, (shmem or 0) / 1024)
    return out


def session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (a zombie whose parent is gone is not counted)."""
    return [pid for pid, (state, ppid, session) in _live_stats().items()
            if session == sid and not (state == "Z" and ppid == 1)]


def parse_gauges(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text exposition: name -> value."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "{" in line:
            continue
        name, _, value = line.partition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


@dataclass
class Stopped:
    code: int | None  # the server's exit status (None: it had to be killed)
    left: list[int]  # processes of its session alive after the grace period (then killed)


class SoakServer:
    """`python -m specserve.launch_server` on a free port, output to `log_path`."""

    def __init__(self, server_args: list[str], log_path: Path):
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        cmd = [sys.executable, "-m", "specserve.launch_server", "--port", port, "--log-level", "warning",
               "--enable-metrics", *server_args]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_term_with_parent)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"the server was not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def gauges(self) -> dict[str, float]:
        return parse_gauges(httpx.get(f"{self.url}/metrics", timeout=30).text)

    def memory(self) -> dict[str, Memory]:
        return tree_memory(self.proc.pid)

    def stop(self) -> Stopped:
        """SIGTERM, wait; then SIGKILL the whole session if anything of it is left. Idempotent."""
        sid = self.proc.pid  # start_new_session: the server leads its session and process group
        code: int | None = self.proc.poll()
        if code is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                code = None
        deadline = time.monotonic() + 10
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = session_pids(sid)
        if left or code is None:
            try:
                os.killpg(sid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        return Stopped(code, left)
