"""End-to-end: more than one HTTP front-end process (--tokenizer-worker-num).

With two front ends and two replicas, eight concurrent greedy requests answer what one
engine answers, both front ends take connections, and every front end reports the
engines' metrics. A front end that dies stops the server with an error naming it, and
nothing is left behind; SIGTERM stops every process with status 0 (server_utils). The offline
Engine, which has no HTTP process, refuses the flag.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import pytest

from tests.e2e.server_utils import REPO, assert_stops_with_error, engine_pids, free_port, launched_server, wait_healthy
from tests.e2e.test_server_parallel import QUESTIONS, _ask_all, _chat

pytestmark = pytest.mark.slow


def _front_end_pids(proc: subprocess.Popen) -> list[int]:
    """The launcher's spawned front ends: each leads a process group of its own."""
    return [p for p in engine_pids(proc) if os.getpgid(p) == p]


def test_two_front_ends_serve_as_one(tmp_path):
    from specserve import Engine

    one = Engine(log_level="warning")
    prompts = [one.tokenizer.encode_chat(_chat(q)["messages"]) for q in QUESTIONS]
    want = [r["text"] for r in one.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 10})]
    args = ["--tokenizer-worker-num", "2", "--dp", "2", "--max-running-requests", "2"]
    with launched_server(args, tmp_path / "server.log") as url:
        assert asyncio.run(_ask_all(url)) == want
        seen = set()
        for _ in range(200):  # a new connection each: the kernel hands each to one front end
            seen.add(httpx.get(f"{url}/get_server_info", timeout=30).json()["front_end"])
            if seen == {0, 1}:
                break
        assert seen == {0, 1}
        for _ in range(4):  # whichever front end answers: the engines' own counts
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
            assert f"specserve:num_requests_total {float(len(QUESTIONS))}" in metrics


def test_a_front_end_dying_stops_the_server(tmp_path):
    port, log = free_port(), tmp_path / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "specserve.launch_server", "--tokenizer-worker-num", "2",
                                 "--port", str(port), "--log-level", "warning"], cwd=REPO, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    wait_healthy(proc, f"http://127.0.0.1:{port}", log)
    (front,) = _front_end_pids(proc)
    subprocess.run(["kill", "-9", str(front)], check=True)
    assert_stops_with_error(proc, log, 15, "front-end process specserve-frontend-1 exited")


def test_the_offline_engine_refuses_front_ends():
    from specserve import Engine
    from specserve.core.config import ConfigError

    with pytest.raises(ConfigError, match="--tokenizer-worker-num"):
        Engine(tokenizer_worker_num=2, log_level="warning")
