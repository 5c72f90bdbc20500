"""`specserve bench soak`: N streaming clients for T seconds against a server it starts.

Starts the real server (soak_server.py), asks it the greedy reference prompts one at a time
while idle, then drives two passes of `--clients` concurrent clients for `--seconds` each
(soak_plan.py draws each request: random route, prompt, length and sampling, streaming or
not, a share hung up early, a share of duplicate-rid pairs, a share of greedy references).
After each pass it waits for the engine's gauges to read idle and reads every server
process's resident memory (soak_server.py `Memory`). Then it stops the server and judges
(soak_checks.py): one PASS/FAIL line per check with its figures; the exit status is 1 if
any check failed.

Pass 1 warms the server up (allocator caches, compiled shapes); memory is compared between
the ends of pass 1 and pass 2, so growth there is what load keeps adding. Shared pages are
left out of that comparison (and shown beside it): on the CPU they are the KV pool, which
the prefix cache fills up to the pool's size by design.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from specserve.bench import soak_checks as checks
from specserve.bench.soak_client import Outcome, run_pair, run_plan
from specserve.bench.soak_plan import ROUTES, Mix, Plan, draw, prompt_pool, reference_body, reference_prompts
from specserve.bench.soak_report import pass_summary, print_report
from specserve.bench.soak_server import QUEUED, RUNNING, TOKEN_USAGE, Memory, SoakServer, parse_gauges

DRAIN_TIMEOUT_S = 600.0  # after the pass's deadline, for the requests still out
STARTUP_TIMEOUT_S = 600.0
HTTP_TIMEOUT = httpx.Timeout(600.0, connect=30.0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16, help="concurrent clients in each pass")
    p.add_argument("--seconds", type=float, default=60.0, help="how long each of the two passes sends")
    p.add_argument("--server-args", default="", help="flags for specserve.launch_server, e.g. "
                   "'--speculative-algorithm NGRAM' (the default model unless --model-path is given)")
    p.add_argument("--seed", type=int, default=0, help="seeds every client's sequence of requests")
    p.add_argument("--disconnect-share", type=float, default=Mix.disconnect_share,
                   help="share of requests the client hangs up on before the end")
    p.add_argument("--duplicate-share", type=float, default=Mix.duplicate_share,
                   help="share of turns that send two /generate requests with one rid (the second: 409)")
    p.add_argument("--greedy-share", type=float, default=Mix.greedy_share,
                   help="share of requests that repeat a greedy reference prompt")
    p.add_argument("--greedy-prompts", type=int, default=Mix.greedy_prompts, help="reference prompts")
    p.add_argument("--greedy-max-tokens", type=int, default=Mix.greedy_max_tokens,
                   help="the reference answers' length (they ignore EOS)")
    p.add_argument("--max-tokens", type=int, default=Mix.max_tokens, help="random max_tokens: 1..this")
    p.add_argument("--max-rss-growth-mb", type=float, default=64.0,
                   help="a server process's RSS less its shared pages (the CPU's KV pool) may grow at most this "
                        "much from the end of pass 1 to the end of pass 2 (glibc's retained heap counts: "
                        "docs/benchmarks.md says how to take it out)")
    p.add_argument("--idle-timeout-s", type=float, default=10.0,
                   help="after a pass's last answer, the gauges must read idle within this")
    p.add_argument("--log", default=None, help="the server's output (default: a file in a new temp directory)")
    p.add_argument("--json", default=None, help="also write the report as one JSON object to this file")
    return p


@dataclass
class PassResult:
    name: str
    seconds: float
    outcomes: list[Outcome]
    idle: checks.IdleWait
    memory: dict[str, Memory]


@dataclass
class SoakResult:
    references: dict[tuple[str, int], str] = field(default_factory=dict)
    reference_outcomes: list[Outcome] = field(default_factory=list)
    idle_memory: dict[str, Memory] = field(default_factory=dict)
    idle_token_usage: float = 0.0
    passes: list[PassResult] = field(default_factory=list)
    timings_s: dict[str, float] = field(default_factory=dict)  # startup, references


def _progress(text: str) -> None:
    print(f"soak: {text}", flush=True)


async def _gauges(http: httpx.AsyncClient) -> dict[str, float]:
    return parse_gauges((await http.get("/metrics")).text)


async def wait_idle(http: httpx.AsyncClient, idle_usage: float | None, timeout_s: float) -> checks.IdleWait:
    """Poll /metrics until nothing runs or waits and token usage is `idle_usage` (None: any)."""
    start = time.monotonic()
    while True:
        g = await _gauges(http)
        usage = g.get(TOKEN_USAGE, float("nan"))
        target = usage if idle_usage is None else idle_usage
        reached = checks.is_idle(g, (RUNNING, QUEUED, TOKEN_USAGE), target)
        waited = time.monotonic() - start
        if reached or waited > timeout_s:
            return checks.IdleWait(reached, waited, g.get(RUNNING, float("nan")), g.get(QUEUED, float("nan")),
                                   usage, target)
        await asyncio.sleep(0.2)


async def ask_references(http: httpx.AsyncClient, refs: list[str],
                         mix: Mix) -> tuple[dict[tuple[str, int], str], list[Outcome]]:
    """Each reference prompt on each route, one at a time: the answers load must not change."""
    answers: dict[tuple[str, int], str] = {}
    outcomes: list[Outcome] = []
    for route in ROUTES:
        for i, prompt in enumerate(refs):
            plan = Plan(route, reference_body(route, prompt, mix.greedy_max_tokens), "reference", reference=i)
            out = await run_plan(http, plan)
            if out.status != 200 or 0 not in out.texts:
                raise RuntimeError(f"the idle server did not answer reference {i} on {route}: "
                                   f"{out.status} {out.error or out.transport_error}")
            answers[(route, i)] = out.texts[0]
            outcomes.append(out)
    return answers, outcomes


async def _client(url: str, rng: random.Random, mix: Mix, pool: list[str], refs: list[str],
                  deadline: float, tag: str) -> list[Outcome]:
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=2)
    async with httpx.AsyncClient(base_url=url, timeout=HTTP_TIMEOUT, limits=limits) as http:
        turn = 0
        while time.monotonic() < deadline:
            plans = draw(rng, mix, pool, refs, rid=f"soak-{tag}-{turn}")
            outcomes += await (run_pair(http, *plans) if len(plans) == 2 else _one(http, plans[0]))
            turn += 1
    return outcomes


async def _one(http: httpx.AsyncClient, plan: Plan) -> list[Outcome]:
    return [await run_plan(http, plan)]


async def run_pass(url: str, args: argparse.Namespace, mix: Mix, refs: list[str],
                   name: str) -> tuple[float, list[Outcome]]:
    """`args.clients` clients sending turns until `args.seconds` have passed; then each ends its turn."""
    pool, start = prompt_pool(), time.monotonic()
    deadline = start + args.seconds
    rngs = [random.Random(f"{args.seed}/{name}/{c}") for c in range(args.clients)]
    jobs = [_client(url, rng, mix, pool, refs, deadline, f"{name}-{c}") for c, rng in enumerate(rngs)]
    per_client = await asyncio.wait_for(asyncio.gather(*jobs), args.seconds + DRAIN_TIMEOUT_S)
    return time.monotonic() - start, [o for outs in per_client for o in outs]


async def soak(server: SoakServer, args: argparse.Namespace, mix: Mix, result: SoakResult) -> None:
    """Fill `result` as the soak goes (a failure part-way still reports what was done)."""
    refs = reference_prompts(prompt_pool(), args.greedy_prompts)
    async with httpx.AsyncClient(base_url=server.url, timeout=HTTP_TIMEOUT) as http:
        start = time.monotonic()
        result.references, result.reference_outcomes = await ask_references(http, refs, mix)
        result.timings_s["references"] = time.monotonic() - start
        _progress(f"{len(result.references)} reference answers in {result.timings_s['references']:.0f} s")
        first = await wait_idle(http, None, args.idle_timeout_s)
        if not first.reached:
            raise RuntimeError(f"the server did not settle after the reference requests: {first}")
        result.idle_token_usage, result.idle_memory = first.token_usage, server.memory()
        for name in ("pass 1", "pass 2"):
            seconds, outcomes = await run_pass(server.url, args, mix, refs, name.replace(" ", ""))
            idle = await wait_idle(http, result.idle_token_usage, args.idle_timeout_s)
            result.passes.append(PassResult(name, seconds, outcomes, idle, server.memory()))
            _progress(f"{name}: {len(outcomes)} requests in {seconds:.0f} s")


def judge(result: SoakResult, args: argparse.Namespace) -> list[checks.Check]:
    everything = result.reference_outcomes + [o for p in result.passes for o in p.outcomes]
    loaded = [o for p in result.passes for o in p.outcomes]
    verdicts = [checks.no_5xx(everything), checks.answered(everything), checks.conflicts(loaded),
                checks.greedy_unchanged(loaded, result.references)]
    verdicts += [checks.back_to_idle(p.name, p.idle, args.idle_timeout_s) for p in result.passes]
    if len(result.passes) == 2:
        verdicts.append(checks.bounded_memory(result.passes[0].memory, result.passes[1].memory,
                                              args.max_rss_growth_mb))
    return verdicts


def _mix(args: argparse.Namespace) -> Mix:
    return Mix(disconnect_share=args.disconnect_share, duplicate_share=args.duplicate_share,
               greedy_share=args.greedy_share, max_tokens=args.max_tokens,
               greedy_max_tokens=args.greedy_max_tokens, greedy_prompts=args.greedy_prompts)


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through main's `finally`, which stops the server


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _terminated)
    log = Path(args.log) if args.log else Path(tempfile.mkdtemp(prefix="specserve-soak-")) / "server.log"
    server = SoakServer(shlex.split(args.server_args), log)
    result = SoakResult()
    verdicts: list[checks.Check] = []
    try:
        start = time.monotonic()
        server.wait_healthy(STARTUP_TIMEOUT_S)
        result.timings_s["startup"] = time.monotonic() - start
        _progress(f"server up at {server.url} after {result.timings_s['startup']:.0f} s")
        asyncio.run(soak(server, args, _mix(args), result))
        verdicts = judge(result, args)
    except (RuntimeError, asyncio.TimeoutError, httpx.HTTPError) as exc:
        verdicts = [checks.Check("soak ran to the end", False, f"{type(exc).__name__}: {exc}")]
    finally:
        stopped = server.stop()  # whatever happened: no process of the server's session is left
        signal.signal(signal.SIGTERM, previous)
    text = log.read_text(errors="replace")
    verdicts.append(checks.clean_exit(stopped.code, stopped.left, text))
    print_report(args, result, verdicts, log)
    if args.json:
        Path(args.json).write_text(json.dumps(_row(args, result, verdicts), indent=1) + "\n")
    return 0 if all(v.ok for v in verdicts) else 1


def _row(args: argparse.Namespace, result: SoakResult, verdicts: list[checks.Check]) -> dict:
    def mem(m: dict[str, Memory]) -> dict[str, dict[str, float]]:
        return {k: asdict(v) for k, v in m.items()}

    return {"bench": "soak", "args": vars(args), "idle_memory_mb": mem(result.idle_memory),
            "passes": [{**pass_summary(p.outcomes, p.seconds), "name": p.name, "idle": asdict(p.idle),
                        "memory_mb": mem(p.memory)} for p in result.passes],
            "timings_s": result.timings_s, "checks": [asdict(v) for v in verdicts],
            "ok": all(v.ok for v in verdicts)}


if __name__ == "__main__":
    raise SystemExit(main())
