"""`specserve bench serving`: concurrent clients against the real HTTP server.

Starts `specserve.launch_server` with the given flags (or uses --url), sends MT-bench
prompts from --concurrency client threads through the streaming OpenAI completions API,
and reports request throughput, output tokens/s, mean TTFT (time to the first streamed
text) and TPOT ((last - first chunk) / (tokens - 1)), plus the server's mean accept
length from /get_server_info. One summary line, one JSON line.
"""
from __future__ import annotations

import argparse
import json
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from statistics import mean

from specserve.bench.prompts import mt_bench_first_turns
from specserve.bench.report import report


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench serving")
    p.add_argument("--server-args", default="", help="flags for specserve.launch_server, e.g. "
                   "'--speculative-algorithm NGRAM'")
    p.add_argument("--url", default=None, help="an already running server instead")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--output", default="bench_serving.jsonl")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(server_args: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "specserve.launch_server", "--port", str(port), "--log-level", "warning",
           *shlex.split(server_args)]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(1)
    proc.terminate()
    raise RuntimeError("the server did not become healthy within 600 s")


def _one(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """Stream one completion; timestamps of the first and last text chunks, token count."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    start, first, last, tokens = time.perf_counter(), None, None, 0
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                last = time.perf_counter()
                first = first or last
    first = first or time.perf_counter()
    return {"ttft": first - start, "tpot": (last - first) / (tokens - 1) if last and tokens > 1 else 0.0,
            "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    proc, url = (None, args.url) if args.url else _start(args.server_args)
    try:
        turns = mt_bench_first_turns()
        prompts = [turns[i % len(turns)] for i in range(args.num_prompts)]  # the 80 questions, cycled
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
            model = json.load(resp)["data"][0]["id"]
        _one(url, model, "Say hello.", 8)  # warm-up, not a benchmark prompt
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda p: _one(url, model, p, args.max_tokens), prompts))
        seconds = time.perf_counter() - start
        with urllib.request.urlopen(f"{url}/get_server_info", timeout=10) as resp:
            info = json.load(resp)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    tokens = sum(r["tokens"] for r in results)
    accept = (info.get("internal_states") or [{}])[0].get("avg_spec_accept_length")
    row = {"bench": "serving", "server_args": args.server_args, "num_prompts": len(prompts),
           "concurrency": args.concurrency, "max_tokens": args.max_tokens, "seconds": seconds,
           "request_throughput": len(prompts) / seconds, "output_tok_s": tokens / seconds,
           "mean_ttft_ms": 1e3 * mean(r["ttft"] for r in results),
           "mean_tpot_ms": 1e3 * mean(r["tpot"] for r in results), "accept_length": accept,
           "device": info.get("device")}
    report(f"serving [{args.server_args or 'plain'}] c={args.concurrency}: {row['request_throughput']:.2f} req/s, "
           f"{row['output_tok_s']:.1f} tok/s, TTFT {row['mean_ttft_ms']:.0f} ms, TPOT {row['mean_tpot_ms']:.1f} ms"
           + (f", accept len {accept:.2f}" if accept else "") + f" ({row['device']})", row, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
