"""End-to-end: `specserve bench soak`, short, against the default model on the CPU.

Six clients for 10 s a pass with small answers: the bench starts its own server, and every
check it makes must pass (no 5xx, valid finish reasons, 409s only for duplicate rids, greedy
answers as when idle, back to idle after each pass, bounded RSS growth, a clean shutdown).
The shares of duplicate-rid pairs and greedy references are raised so that a short run has
some of each.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from tests.e2e.server_utils import REPO

pytestmark = [pytest.mark.slow, pytest.mark.serial]

ARGS = ["--clients", "6", "--seconds", "10", "--max-tokens", "8", "--greedy-prompts", "2",
        "--greedy-max-tokens", "6", "--greedy-share", "0.25", "--duplicate-share", "0.15",
        "--disconnect-share", "0.2", "--seed", "1"]
LIMIT_S = 400  # a guard only: the run takes well under 2 minutes on the 2-core machine


def test_short_soak_passes_every_check(tmp_path):
    report = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "specserve.cli", "bench", "soak", *ARGS,
           "--log", str(tmp_path / "server.log"), "--json", str(report)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the bench stops its server on SIGTERM
        out, _ = proc.communicate(timeout=120)
        pytest.fail(f"the soak did not finish in {LIMIT_S} s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    row = json.loads(report.read_text())
    assert row["ok"] and all(c["ok"] for c in row["checks"]), out[-4000:]
    names = {c["name"] for c in row["checks"]}
    assert {"no 5xx", "valid finish", "409 only for duplicate rids", "greedy unchanged", "idle after pass 1",
            "idle after pass 2", "clean shutdown"} <= names
    assert all(p["requests"] > 0 for p in row["passes"]) and len(row["passes"]) == 2
