"""`python -m specserve.bench.ngram_cost`: the NGRAM proposer's CPU cost per decode step.

Batch 64, SGLang's default NGRAM parameters (N = max window = 12), ~500-token histories of a
text-like stream: a sparse random Markov chain (a few likely successors per token) with
phrases copied from earlier in the request, as in edits or summaries. Each step drafts for the
whole batch (`propose`) and then feeds 1-4 committed tokens per request (`on_tokens`). Runs BFS
and PROB on an unbounded trie, then BFS again with a capacity small enough that every new node
evicts one (a long-running server's steady state), and prints one line. No model, no GPU.
"""
from __future__ import annotations

import argparse
import random
import time
from collections.abc import Iterator
from typing import TypedDict

import numpy as np

from specserve.core.config import SpecConfig
from specserve.spec.ngram.proposer import NgramProposer


class TextLike:
    """Token streams: Markov successors, or with probability `copy` a phrase copied from the
    stream's own past (what n-gram drafting is for)."""

    def __init__(self, vocab: int, seed: int, copy: float = 0.03) -> None:
        rng = np.random.default_rng(seed)
        self.succ = [rng.choice(vocab, size=int(rng.integers(2, 9))).tolist() for _ in range(vocab)]
        self.weights = [sorted(rng.dirichlet(np.full(len(s), 0.5)).tolist(), reverse=True)
                        for s in self.succ]
        self.vocab, self.copy = vocab, copy

    def stream(self, rnd: random.Random) -> Iterator[int]:
        hist = [rnd.randrange(self.vocab)]
        pending: list[int] = []  # a copied phrase, reversed: the next token is the last
        while True:
            if not pending and len(hist) > 32 and rnd.random() < self.copy:
                start = rnd.randrange(len(hist) - 16)
                pending = hist[start:start + rnd.randint(4, 16)][::-1]
            last = hist[-1]
            t = pending.pop() if pending else rnd.choices(self.succ[last], self.weights[last])[0]
            hist.append(t)
            yield t


class Cost(TypedDict):
    """One run's timings (us) and what the drafts and the trie did."""

    propose: np.ndarray  # per step: `propose` for the whole batch
    update: np.ndarray  # per request and step: `on_tokens`
    update_step: np.ndarray  # per step: `on_tokens` summed over the batch
    prompt_us: float  # `add_request` per prompt token
    nodes: float  # draft tokens per request and step
    evicted: int  # trie nodes evicted


def run(match_type: str, capacity: int, batch: int, history: int, steps: int, seed: int) -> Cost:
    d = SpecConfig()
    ngram = NgramProposer(
        min_window=d.ngram_min_match_window_size, max_window=d.ngram_max_match_window_size,
        min_bfs_breadth=d.ngram_min_bfs_breadth, max_bfs_breadth=d.ngram_max_bfs_breadth,
        match_type=match_type, branch_length=d.ngram_branch_length, capacity=capacity,
        num_draft_tokens=d.ngram_max_match_window_size)
    text, rnd = TextLike(vocab=2000, seed=seed), random.Random(seed)
    streams = {f"r{b}": text.stream(rnd) for b in range(batch)}
    prompt_len = history - 5 * steps // 2  # ~2.5 tokens per step bring it to ~history
    prompts = {rid: [next(s) for _ in range(prompt_len)] for rid, s in streams.items()}
    t0 = time.perf_counter()
    for rid, prompt in prompts.items():
        ngram.add_request(rid, prompt)
    prompt_us = (time.perf_counter() - t0) * 1e6 / (batch * prompt_len)
    rids, roots = list(streams), [p[-1] for p in prompts.values()]
    propose_us, update_us, nodes = [], [], 0
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        drafts = ngram.propose(rids, roots)
        propose_us.append((time.perf_counter_ns() - t0) / 1e3)
        nodes += int(drafts.valid.sum()) - batch
        for b, rid in enumerate(rids):
            tokens = [next(streams[rid]) for _ in range(rnd.randint(1, 4))]
            t0 = time.perf_counter_ns()
            ngram.on_tokens(rid, tokens)
            update_us.append((time.perf_counter_ns() - t0) / 1e3)
            roots[b] = tokens[-1]
    update = np.asarray(update_us)
    return Cost(propose=np.asarray(propose_us), update=update,
                update_step=update.reshape(steps, batch).sum(1), prompt_us=prompt_us,
                nodes=nodes / steps / batch, evicted=ngram.trie.evicted)


def _ms(a: np.ndarray) -> str:
    return f"{a.mean():.0f}/{np.percentile(a, 99):.0f}"


def _ms_min(a: np.ndarray) -> str:  # the min shows what a quiet machine gives (shared cores)
    return f"{_ms(a)} (min {a.min():.0f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specserve.bench.ngram_cost")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--history", type=int, default=500)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--full-capacity", type=int, default=100_000, help="the at-capacity run")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    shape = (a.batch, a.history, a.steps, a.seed)
    bfs = run("BFS", SpecConfig().ngram_capacity, *shape)
    prob = run("PROB", SpecConfig().ngram_capacity, *shape)
    full = run("BFS", a.full_capacity, *shape)
    # a small run (batch 1) never fills the trie: then there is no at-capacity figure to give
    at_capacity = (f"{_ms(full['update'])}, {full['update_step'].mean():.0f}/step" if full["evicted"] > 0
                   else "not reached (nothing evicted)")
    print(f"ngram_cost bs={a.batch} hist~{a.history} N=12, us mean/p99: "
          f"propose(batch) BFS {_ms_min(bfs['propose'])} PROB {_ms_min(prob['propose'])} "
          f"({bfs['nodes']:.1f}/{prob['nodes']:.1f} drafts/req) | "
          f"on_tokens(1 req, 1-4 tok) {_ms(bfs['update'])}, {bfs['update_step'].mean():.0f}/step; "
          f"at capacity {a.full_capacity}: {at_capacity} | prompt indexing "
          f"{bfs['prompt_us']:.1f} us/token", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
