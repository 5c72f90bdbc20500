"""`specserve bench serving`: concurrent clients against the real HTTP server.

Starts `specserve.launch_server` with the given flags (or uses --url), sends MT-bench
prompts from --concurrency client threads through the streaming OpenAI completions API,
(split over --client-procs processes, so that the clients' own parsing is not what
limits a fast server) and reports request throughput, output tokens/s, mean TTFT (time to the first streamed
text) and TPOT ((last - first chunk) / (tokens - 1)), plus the server's mean accept
length from /get_server_info. One summary line, one JSON line.

With --offline the same prompts also run through the offline `Engine` (engine in this
process, no HTTP, no pipes) under the same flags, in waves of --concurrency (with
--ignore-eos every request of a wave ends together, as the closed-loop clients do), and
the report gives the server's tokens/s over the offline engine's: what the server's
processes, pipes and streaming cost. The server runs first and has exited by then.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
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
    p.add_argument("--client-procs", type=int, default=None, help="client processes (default: one per 8 "
                   "clients, at most 8)")
    p.add_argument("--ignore-eos", action="store_true", help="every answer runs to --max-tokens "
                   "(random weights: their EOS can come at any point)")
    p.add_argument("--offline", action="store_true", help="also time the offline Engine on the same "
                   "prompts with the same flags, and report server / offline")
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


def _one(url: str, model: str, prompt: str, max_tokens: int, ignore_eos: bool = False) -> dict:
    """Stream one completion; timestamps of the first and last text chunks, token count."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
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


def _clients(args: argparse.Namespace, url: str, model: str, prompts: list[str]) -> tuple[list[dict], float]:
    """Run every prompt through --concurrency closed-loop clients; results and seconds."""
    procs = max(1, min(args.concurrency, args.client_procs or min(8, -(-args.concurrency // 8))))
    threads = [args.concurrency // procs + (k < args.concurrency % procs) for k in range(procs)]
    shares = [(url, model, prompts[k::procs], args.max_tokens, args.ignore_eos, threads[k]) for k in range(procs)]
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        pool.map(time.sleep, [0.5] * procs, chunksize=1)  # every worker up before the clock starts
        start = time.perf_counter()
        results = [r for share in pool.starmap(_share, shares, chunksize=1) for r in share]
        return results, time.perf_counter() - start


def _share(url: str, model: str, prompts: list[str], max_tokens: int, ignore_eos: bool, threads: int) -> list[dict]:
    """One client process: `threads` closed-loop clients over `prompts`."""
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda p: _one(url, model, p, max_tokens, ignore_eos), prompts))


def _offline_tok_s(args: argparse.Namespace, prompts: list[str]) -> float:
    """Output tokens/s of the offline Engine on `prompts`, in waves of --concurrency."""
    from specserve.args import parse_config
    from specserve.offline import Engine

    engine = Engine(config=parse_config([*shlex.split(args.server_args), "--log-level", "warning"]))
    try:
        params = {"max_new_tokens": args.max_tokens, "temperature": 0, "ignore_eos": args.ignore_eos}
        engine.generate(["Say hello."], {**params, "max_new_tokens": 8})  # warm-up, as for the server
        start, tokens = time.perf_counter(), 0
        for i in range(0, len(prompts), args.concurrency):
            outs = engine.generate(prompts[i:i + args.concurrency], params)
            tokens += sum(o["meta_info"]["completion_tokens"] for o in outs)
        return tokens / (time.perf_counter() - start)
    finally:
        engine.shutdown()


def _ratio(num: float, den: float | None) -> float | None:
    return num / den if den else None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    proc, url = (None, args.url) if args.url else _start(args.server_args)
    try:
        turns = mt_bench_first_turns()
        prompts = [turns[i % len(turns)] for i in range(args.num_prompts)]  # the 80 questions, cycled
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
            model = json.load(resp)["data"][0]["id"]
        _one(url, model, "Say hello.", 8)  # warm-up, not a benchmark prompt
        results, seconds = _clients(args, url, model, prompts)
        with urllib.request.urlopen(f"{url}/get_server_info", timeout=10) as resp:
            info = json.load(resp)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    tokens = sum(r["tokens"] for r in results)
    offline = _offline_tok_s(args, prompts) if args.offline else None
    accept = (info.get("internal_states") or [{}])[0].get("avg_spec_accept_length")
    row = {"bench": "serving", "server_args": args.server_args, "num_prompts": len(prompts),
           "concurrency": args.concurrency, "max_tokens": args.max_tokens, "seconds": seconds,
           "request_throughput": len(prompts) / seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
           "mean_ttft_ms": 1e3 * mean(r["ttft"] for r in results),
           "mean_tpot_ms": 1e3 * mean(r["tpot"] for r in results), "accept_length": accept,
           "device": info.get("device"), "offline_tok_s": offline,
           "server_over_offline": _ratio(tokens / seconds, offline)}
    report(f"serving [{args.server_args or 'plain'}] c={args.concurrency}: {row['request_throughput']:.2f} req/s, "
           f"{row['output_tok_s']:.1f} tok/s, TTFT {row['mean_ttft_ms']:.0f} ms, TPOT {row['mean_tpot_ms']:.1f} ms"
           + (f", accept len {accept:.2f}" if accept else "")
           + (f"; offline {offline:.1f} tok/s, server/offline {row['server_over_offline']:.3f}" if offline else "")
           + f" ({row['device']})", row, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
