"""`specserve bench governor-sim`: the speculation governor (spec/governor.py) at batch 1 on
a simulated clock, against always speculating.

A GPU run of MT-bench at batch 1 varies from host to host and round to round by more
than the governor's own cost, so its policy is compared here on a model of that run whose
every number can be set: 80 requests of 256 tokens, a verify committing 1
to `max_accept` tokens (each further draft token accepted with a probability that drifts
per stretch of text around the request's own), speculative and plain steps of fixed cost,
a first speculative step after plain ones `cold_ms` dearer (no tree drafted ahead), a
drain at each switch, rare host pauses, a prefill between requests. Every policy sees the
same text (its acceptances are drawn per position, before any step runs), so the ratio
to always speculating is the policy's cost alone. The defaults stand for SmolLM2-135M with
its EAGLE-3 head on a GPU; docs/benchmarks.md has the measured step costs they come from.
It is a model, not a measurement: it says which policy loses less on such traffic.
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass

from specserve.spec.governor import WARM_STEPS, SpecGovernor

REQUESTS, MAX_NEW = 80, 256


@dataclass(frozen=True)
class Traffic:
    accept_mean: float = 0.78  # mean probability that the next draft token is accepted
    accept_sd: float = 0.06  # its spread over requests
    stretch_sd: float = 0.12  # and over stretches of 40-250 positions within one
    max_accept: int = 7  # tokens one verify commits at most
    spec_ms: float = 0.90
    plain_ms: float = 0.53
    cold_ms: float = 0.30
    drain_ms: float = 0.50
    pause_rate: float = 0.002  # host pauses of 2-10 ms per step
    prefill_ms: float = 3.0


def texts(t: Traffic, seed: int) -> list[list[int]]:
    """Per request, the tokens a verify starting at each position commits."""
    rng = random.Random(seed)
    out = []
    for _ in range(REQUESTS):
        own = min(0.95, max(0.3, rng.gauss(t.accept_mean, t.accept_sd)))
        accepts, left, p = [], 0, own
        for _ in range(MAX_NEW):
            if left == 0:
                left, p = rng.randint(40, 250), min(0.97, max(0.2, rng.gauss(own, t.stretch_sd)))
            left -= 1
            n = 1
            while n < t.max_accept and rng.random() < p:
                n += 1
            accepts.append(n)
        out.append(accepts)
    return out


def run(t: Traffic, seed: int, governed: bool) -> dict:
    """One round: tokens/s, and steps of each mode. The worker's timing is mirrored: a
    step runs from its start to the next one's start, a pipelined speculative step's
    tokens land with the next step, the drain at a switch is charged to no step, and the
    step before a prefill goes unmeasured."""
    rng, now = random.Random(seed + 1), 0.0
    gov = SpecGovernor(governed, clock=lambda: now)
    steps = {True: 0, False: 0}
    for accepts in texts(t, seed):
        pos, last, run_len, pending, open_step = 0, None, 0, 0, None
        while pos < MAX_NEW:
            spec = gov.speculate(1)
            if open_step is not None:
                gov.record(1, open_step[0], open_step[1], now - open_step[2], switched=open_step[3])
            if last is not None and last != spec:
                now += t.drain_ms / 1e3
            run_len = run_len + 1 if last == spec else 1
            start, cost = now, (t.spec_ms + (t.cold_ms if run_len == 1 else 0.0)) if spec else t.plain_ms
            tokens = min(accepts[pos], MAX_NEW - pos) if spec else 1
            landed = (pending if last else 0) if spec else 1  # speculative tokens land a step late
            pending = tokens if spec else 0
            if rng.random() < t.pause_rate:
                cost += rng.uniform(2.0, 10.0)
            now += cost / 1e3
            pos, last, steps[spec] = pos + tokens, spec, steps[spec] + 1
            open_step = (spec, landed, start, run_len <= WARM_STEPS)
        assert last is not None  # MAX_NEW > 0: every request ran at least one step
        gov.unmeasured(1, last)
        now += t.prefill_ms / 1e3
    return {"tok_s": REQUESTS * MAX_NEW / now, "spec_steps": steps[True], "plain_steps": steps[False]}


def compare(t: Traffic, seeds: range) -> list[dict]:
    """Per seed: the governed round against always speculating."""
    rows = []
    for seed in seeds:
        governed, always = run(t, seed, True), run(t, seed, False)
        rows.append({"seed": seed, "ratio": governed["tok_s"] / always["tok_s"], **governed})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specserve bench governor-sim", description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=12)
    for name, default in vars(Traffic()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    args = p.parse_args(argv)
    traffic = Traffic(**{k: getattr(args, k) for k in vars(Traffic())})
    rows = compare(traffic, range(args.seeds))
    for row in rows:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    ratios = [r["ratio"] for r in rows]
    print(f"governed / always speculating: mean {sum(ratios) / len(ratios):.3f}, worst {min(ratios):.3f}")
    return 0
