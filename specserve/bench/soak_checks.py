"""The verdicts of `specserve bench soak`: pure functions from what was recorded to PASS/FAIL.

Owns what "the server survived" means: no 5xx anywhere (statuses and in-band stream errors);
every request that stayed connected answered 200 with a finish reason of stop or length for
each of its choices (a 409 only for the second of a duplicate-rid pair); the engine back to
idle after each pass; each process's memory after pass 2 within a bound of pass 1's; greedy
answers under load equal to the idle server's; a clean exit on SIGTERM. Each check returns a
`Check` carrying the figures it judged; none of them talks to the server.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from specserve.bench.soak_client import Outcome
from specserve.bench.soak_server import Memory

VALID_FINISH = ("stop", "length")
REFERENCE_KINDS = ("greedy", "first", "second")
EXAMPLES = 3  # failures quoted per check


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}  {self.name}: {self.detail}"


@dataclass(frozen=True)
class IdleWait:
    """After a pass: how long until the gauges read idle (or the wait gave up), and their values."""

    reached: bool
    seconds: float
    running: float
    queued: float
    token_usage: float
    idle_token_usage: float  # the value before any load


def is_idle(gauges: Mapping[str, float], names: tuple[str, str, str], idle_usage: float) -> bool:
    running, queued, usage = (gauges.get(n, math.nan) for n in names)
    return running == 0 and queued == 0 and math.isclose(usage, idle_usage, rel_tol=0, abs_tol=1e-9)


def _examples(items: Iterable[str]) -> str:
    items = list(items)
    return "" if not items else "; e.g. " + " | ".join(items[:EXAMPLES])


def _describe(o: Outcome) -> str:
    what = f"{o.kind} {o.route}{' stream' if o.stream else ''}"
    if o.transport_error:
        return f"{what}: {o.transport_error[:120]}"
    if o.error is not None:
        return f"{what}: {o.error_code} {str(o.error.get('message'))[:120]}"
    return f"{what}: status {o.status}, finish {o.finish}"


def no_5xx(outcomes: list[Outcome]) -> Check:
    bad = [o for o in outcomes if (o.status or 0) >= 500 or (o.error_code or 0) >= 500]
    return Check("no 5xx", not bad, f"{len(bad)} of {len(outcomes)} requests" + _examples(map(_describe, bad)))


def _answer_problem(o: Outcome) -> str | None:
    """Why a request that stayed connected did not end well (None: it did)."""
    if o.transport_error is not None:
        return "transport"
    if o.kind == "second" and o.status == 409:
        return None  # judged by `conflicts`
    if o.status != 200 or o.error is not None:
        return "status"
    reasons = [o.finish.get(i) for i in range(o.choices)]
    return None if all(r in VALID_FINISH for r in reasons) else "finish"


def answered(outcomes: list[Outcome]) -> Check:
    """Every request the client did not hang up on: 200, and each choice stopped or ran to length."""
    kept = [o for o in outcomes if not o.closed_early]
    problems = [(o, p) for o in kept if (p := _answer_problem(o)) is not None]
    counts = Counter(p for _, p in problems)
    reasons = Counter(r for o in kept for r in o.finish.values())
    detail = (f"{len(kept) - len(problems)} of {len(kept)} connected requests ended well "
              f"(finish reasons {dict(sorted(reasons.items()))}; {len(outcomes) - len(kept)} hung up on purpose)")
    if problems:
        detail += f"; failed: {dict(counts)}" + _examples(_describe(o) for o, _ in problems)
    return Check("valid finish", not problems, detail)


def conflicts(outcomes: list[Outcome]) -> Check:
    """409s: only for the second of a duplicate-rid pair, with the conflict body; and the
    pairs were refused at all (a first request is in flight for a whole greedy answer)."""
    seconds = [o for o in outcomes if o.kind == "second"]
    refused = [o for o in seconds if o.status == 409]
    wrong_body = [o for o in refused if (o.error or {}).get("type") != "conflict_error"
                  or (o.error or {}).get("param") != "rid"]
    stray = [o for o in outcomes if o.status == 409 and o.kind != "second"]
    other = [o for o in seconds if o.status not in (200, 409) and not o.closed_early]
    ok = not (wrong_body or stray or other) and (not seconds or bool(refused))
    detail = (f"{len(refused)} of {len(seconds)} duplicate rids refused with 409 "
              f"({len(seconds) - len(refused)} served: the first had ended), {len(stray)} 409s elsewhere")
    bad = stray + wrong_body + other
    return Check("409 only for duplicate rids", ok, detail + _examples(map(_describe, bad)))


def greedy_unchanged(outcomes: list[Outcome], references: Mapping[tuple[str, int], str]) -> Check:
    compared, mismatched = 0, []
    for o in outcomes:
        if o.kind not in REFERENCE_KINDS or o.closed_early or o.status != 200 or o.reference is None:
            continue
        want = references[(o.route, o.reference)]
        for index in range(o.choices):
            compared += 1
            got = o.texts.get(index, "")
            if got != want:
                mismatched.append(f"{o.route} prompt {o.reference} choice {index}: {got[:60]!r} != {want[:60]!r}")
    detail = f"{compared - len(mismatched)} of {compared} answers equal the idle server's" + _examples(mismatched)
    return Check("greedy unchanged", not mismatched and compared > 0, detail)


def back_to_idle(name: str, wait: IdleWait, timeout_s: float) -> Check:
    detail = (f"running {wait.running:g}, queued {wait.queued:g}, token usage {wait.token_usage:.4f} "
              f"(idle {wait.idle_token_usage:.4f}) ")
    detail += f"after {wait.seconds:.1f} s" if wait.reached else f"still, after {timeout_s:g} s"
    return Check(f"idle after {name}", wait.reached, detail)


def bounded_memory(after1: Mapping[str, Memory], after2: Mapping[str, Memory], limit_mb: float) -> Check:
    """Each process's RSS less its shared pages (on the CPU: the KV pool, touched as slots are
    first used) after pass 2 at most `limit_mb` above the same after pass 1 (same pids).
    The shared pages' growth is reported beside it."""
    parts, ok = [], after1.keys() == after2.keys() and bool(after1)
    for key in sorted(after1.keys() | after2.keys()):
        if key not in after1 or key not in after2:
            parts.append(f"{key} {'gone' if key in after1 else 'new'}")
            continue
        a, b = after1[key], after2[key]
        growth = b.private_mb - a.private_mb
        ok = ok and growth <= limit_mb
        parts.append(f"{key} {a.private_mb:.0f} -> {b.private_mb:.0f} MiB ({growth:+.1f}; "
                     f"shared {b.shmem_mb - a.shmem_mb:+.1f})")
    return Check(f"RSS growth <= {limit_mb:g} MiB", ok, ", ".join(parts) or "no process found")


def clean_exit(code: int | None, left: list[int], log: str) -> Check:
    ok = code == 0 and not left and "Traceback" not in log
    detail = f"exit status {code}, {len(left)} processes left, {log.count('Traceback')} tracebacks in the log"
    return Check("clean shutdown", ok, detail)
