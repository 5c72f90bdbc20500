"""End-to-end: data-parallel replicas, tensor-parallel ranks on one host and on two
"hosts" (two launches on 127.0.0.1), and what happens when a rank dies.

DP 2 with two running requests per replica: eight concurrent greedy requests all answer
what one engine answers, both replicas serve some, and /get_server_info and /metrics show
each replica. A two-node TP 2 group answers, and Ctrl-C-free shutdown (SIGTERM to node 0)
ends both hosts with status 0. Killing a rank (on the server's host, or on the other one)
ends the server within seconds with an error naming it, and leaves no process behind.
"""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.server_utils import (
    REPO,
    assert_session_empties,
    assert_stops_with_error,
    engine_pids,
    free_port,
    free_port_pair,
    launched_server,
    stop_and_check,
    wait_healthy,
)

pytestmark = pytest.mark.slow

QUESTIONS = [f"Name a colour and the number {i}." for i in range(8)]


def _chat(content: str) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 10, "temperature": 0}


async def _ask_all(url: str) -> list[str]:
    async with httpx.AsyncClient(timeout=300) as client:
        replies = await asyncio.gather(*(client.post(f"{url}/v1/chat/completions", json=_chat(q))
                                         for q in QUESTIONS))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    return [r.json()["choices"][0]["message"]["content"] for r in replies]


def test_dp2_spreads_requests_and_answers_as_one_engine(tmp_path):
    from specserve import Engine

    one = Engine(log_level="warning")
    prompts = [one.tokenizer.encode_chat(_chat(q)["messages"]) for q in QUESTIONS]
    want = [r["text"] for r in one.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 10})]
    with launched_server(["--dp", "2", "--max-running-requests", "2"], tmp_path / "server.log") as url:
        assert asyncio.run(_ask_all(url)) == want
        info = httpx.get(f"{url}/get_server_info", timeout=30).json()
        assert info["dp_size"] == 2
        routed = [r["requests_routed"] for r in info["replicas"]]
        assert sum(routed) == len(QUESTIONS) and min(routed) > 0, routed
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert 'specserve:replica_num_requests_total{dp_rank="1"}' in metrics
        assert f"specserve:num_requests_total {float(len(QUESTIONS))}" in metrics


def _launch(node: int, addr: str, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specserve.launch_server", "--tp", "2", "--nnodes", "2", "--node-rank", str(node),
           "--dist-init-addr", addr, "--port", str(port), "--log-level", "warning"]
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _two_nodes(tmp_path) -> tuple[subprocess.Popen, subprocess.Popen, str]:
    addr, port = f"127.0.0.1:{free_port_pair()}", free_port()  # the hosts' watch listens on addr's port + 1
    node1 = _launch(1, addr, free_port(), tmp_path / "node1.log")  # its port goes unused: node 0 serves
    node0 = _launch(0, addr, port, tmp_path / "node0.log")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(node0, url, tmp_path / "node0.log")
    reply = httpx.post(f"{url}/v1/chat/completions", json=_chat("What is the capital of France?"), timeout=120)
    assert reply.status_code == 200 and "Paris" in reply.json()["choices"][0]["message"]["content"]
    return node0, node1, url


def test_two_nodes_serve_and_stop_together(tmp_path):
    node0, node1, _ = _two_nodes(tmp_path)
    stop_and_check(node0, tmp_path / "node0.log", signal.SIGTERM)
    assert node1.wait(timeout=30) == 0, (tmp_path / "node1.log").read_text()[-3000:]
    assert_session_empties(node1)


def test_a_rank_dying_on_another_node_stops_the_server(tmp_path):
    node0, node1, _ = _two_nodes(tmp_path)
    (rank1,) = engine_pids(node1)
    subprocess.run(["kill", "-9", str(rank1)], check=True)
    assert_stops_with_error(node0, tmp_path / "node0.log", 15, "error: node 1: tensor-parallel rank 1 exited")
    assert_stops_with_error(node1, tmp_path / "node1.log", 15, "tensor-parallel rank 1 exited")


def test_a_rank_dying_stops_the_server(tmp_path):
    port, log = free_port(), tmp_path / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "specserve.launch_server", "--tp", "2", "--port", str(port),
                                 "--log-level", "warning"], cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    wait_healthy(proc, f"http://127.0.0.1:{port}", log)
    ranks = sorted(engine_pids(proc))
    assert len(ranks) == 2
    subprocess.run(["kill", "-9", str(ranks[1])], check=True)  # spawned second: rank 1
    assert_stops_with_error(proc, log, 15, "tensor-parallel rank 1 exited")
