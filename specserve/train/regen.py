"""On-policy answers: the target regenerates every training answer through `Engine`.

A draft head is scored on the target's own continuations, so it is trained on them: each
prompt (chat template applied) is answered by the target itself, greedy by default, and
once more per `extra_temperatures` entry, sampled with a seed of its own (more on-policy
contexts from the same prompts; held-out splits keep a prompt's answers together). Jobs
are answer-major: every prompt's first answer, then every prompt's second, ... The
results are token-id shards in the output directory:

    <out>/regen.json           the settings the shards were made with (+ the EOS ids)
    <out>/prompts.jsonl        the chosen prompts ({"messages", "ids"}), in shard order
    <out>/shards/00042.pt      {"tokens": int32 [sum n], "lengths": [B], "prompt_lens": [B]}

A sequence is prompt ids + answer ids (EOS included when the answer ended on it); the loss
covers answer positions only. Shards appear by atomic rename, so a rerun skips every shard
that exists and the Engine is only built when one is missing. Rerunning with different
settings into the same directory is an error (the shards would silently mix).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specserve.train.data import Chat, load_chats

META, PROMPTS, SHARDS = "regen.json", "prompts.jsonl", "shards"


@dataclass(frozen=True)
class RegenConfig:
    model: str
    dataset: str
    num_prompts: int
    max_new_tokens: int
    max_seq_len: int  # prompt + answer never exceed this; prompts over half of it are skipped
    temperature: float = 0.0
    seed: int = 0
    shard_size: int = 256
    extra_temperatures: tuple[float, ...] = ()  # one more answer per prompt at each of these
    turns: str = "first"  # which user turns are prompts (data.py)

    @property
    def temperatures(self) -> tuple[float, ...]:
        """The temperature of each answer a prompt gets, in job order."""
        return (self.temperature,) + tuple(self.extra_temperatures)


@dataclass(frozen=True)
class Sequence:
    ids: torch.Tensor  # [n] int64: prompt then answer
    prompt_len: int

    @property
    def answer_len(self) -> int:
        return self.ids.numel() - self.prompt_len


EngineFactory = Callable[[], Any]  # () -> specserve.Engine, built only when a shard is missing


class RegenIncomplete(Exception):
    """The deadline passed with shards still missing; those made are kept (rerun to go on)."""

    def __init__(self, done: int, total: int) -> None:
        super().__init__(f"time limit reached while regenerating answers: {done} of {total} shards made")
        self.done, self.total = done, total


def regenerate(out: Path, cfg: RegenConfig, make_engine: EngineFactory, deadline: float = math.inf) -> list[int]:
    """Make every missing shard of `out`; returns the EOS ids of the target's tokenizer.
    Past `deadline` (time.monotonic()) no new shard is started: RegenIncomplete."""
    out = Path(out)
    (out / SHARDS).mkdir(parents=True, exist_ok=True)
    meta = _check_meta(out, cfg)
    engine = None
    if meta is None or not (out / PROMPTS).is_file():
        engine = make_engine()
        prompts = choose_prompts(load_chats(cfg.dataset, cfg.turns), engine.tokenizer, cfg)
        _write_jsonl(out / PROMPTS, prompts)
        meta = _as_json(cfg) | {"eos_ids": sorted(engine.tokenizer.eos_token_ids)}
        (out / META).write_text(json.dumps(meta, indent=2))
    prompts = [json.loads(line) for line in (out / PROMPTS).read_text().splitlines()]
    jobs = answer_jobs(prompts, cfg)
    chunks = [jobs[i:i + cfg.shard_size] for i in range(0, len(jobs), cfg.shard_size)]
    todo = [k for k in range(len(chunks)) if not shard_path(out, k).is_file()]
    if todo:
        engine = engine or make_engine()
        with _quiet("specserve"):  # the engine's per-batch log lines; the progress bar says enough
            made = _generate_shards(out, engine, chunks, todo, cfg, deadline)
        if made < len(todo):
            raise RegenIncomplete(len(chunks) - len(todo) + made, len(chunks))
    return meta["eos_ids"]


def choose_prompts(chats: list[Chat], tokenizer: Any, cfg: RegenConfig) -> list[dict]:
    """Up to num_prompts prompts in a seeded random order, chat-templated, keeping those
    whose ids fit in half of max_seq_len (the other half is room for the answer)."""
    order = list(range(len(chats)))
    random.Random(cfg.seed).shuffle(order)
    chosen: list[dict] = []
    for i in order:
        if len(chosen) == cfg.num_prompts:
            break
        ids = tokenizer.encode_chat(chats[i])
        if 0 < len(ids) <= cfg.max_seq_len // 2:
            chosen.append({"messages": chats[i], "ids": ids})
    if not chosen:
        raise ValueError(f"no prompt of {cfg.dataset!r} fits --max-seq-len {cfg.max_seq_len}")
    return chosen


def answer_jobs(prompts: list[dict], cfg: RegenConfig) -> list[dict]:
    """One {"ids", "temperature", "seed"} per answer to make, answer-major (module docstring).
    A sampled answer's seed depends on (cfg.seed, answer, prompt) only, so a resumed run
    makes the same answers."""
    return [{"ids": p["ids"], "temperature": t,
             "seed": None if t <= 0 else ((cfg.seed * 1_000_003 + a) * 10_000_019 + i) % (1 << 63)}
            for a, t in enumerate(cfg.temperatures) for i, p in enumerate(prompts)]


def shard_path(out: Path, k: int) -> Path:
    return Path(out) / SHARDS / f"{k:05d}.pt"


def load_sequences(out: Path) -> list[Sequence]:
    """Every regenerated sequence of `out`, shard by shard."""
    seqs = []
    for path in sorted((Path(out) / SHARDS).glob("*.pt")):
        shard = torch.load(path, weights_only=True)
        for ids, p in zip(shard["tokens"].split(shard["lengths"].tolist()), shard["prompt_lens"].tolist()):
            seqs.append(Sequence(ids.long(), p))
    return seqs


# -- internals -------------------------------------------------------------------------------

def _check_meta(out: Path, cfg: RegenConfig) -> dict | None:
    path = out / META
    if not path.is_file():
        return None
    meta = json.loads(path.read_text())
    wanted = _as_json(cfg)
    defaults = _as_json(RegenConfig("", "", 0, 0, 0))  # keys newer than the directory's regen.json
    diff = {k: (meta.get(k, defaults[k]), v) for k, v in wanted.items() if meta.get(k, defaults[k]) != v}
    if diff:
        detail = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in diff.items())
        raise ValueError(f"{out} holds answers regenerated with other settings ({detail}): "
                         "use a fresh --output directory or the same settings")
    return meta


def _as_json(cfg: RegenConfig) -> dict:
    """The settings as regen.json holds them (tuples as lists, so the two compare equal)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}


def _generate_shards(out: Path, engine: Any, chunks: list[list[dict]], todo: list[int],
                     cfg: RegenConfig, deadline: float) -> int:
    """Make the shards `todo` in order until `deadline`; returns how many were made."""
    bar = tqdm(total=len(chunks), initial=len(chunks) - len(todo), desc="regenerate", unit="shard")
    made, shards, start = 0, 0, time.perf_counter()
    for k in todo:
        if time.monotonic() >= deadline:
            break
        ids = [job["ids"] for job in chunks[k]]
        params = [{"temperature": job["temperature"], "seed": job["seed"],
                   "max_new_tokens": max(1, min(cfg.max_new_tokens, cfg.max_seq_len - len(job["ids"])))}
                  for job in chunks[k]]
        answers = [o["output_ids"] for o in engine.generate(input_ids=ids, sampling_params=params)]
        _save_shard(shard_path(out, k), ids, answers)
        made, shards = made + sum(len(a) for a in answers), shards + 1
        bar.update(1)
        bar.set_postfix(gen_tok_s=f"{made / (time.perf_counter() - start):.0f}")
    bar.close()
    return shards


def _save_shard(path: Path, prompts: list[list[int]], answers: list[list[int]]) -> None:
    seqs = [p + a for p, a in zip(prompts, answers)]
    shard = {"tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
             "lengths": torch.tensor([len(s) for s in seqs], dtype=torch.int64),
             "prompt_lens": torch.tensor([len(p) for p in prompts], dtype=torch.int64)}
    tmp = path.with_suffix(".tmp")
    torch.save(shard, tmp)
    os.replace(tmp, path)  # a shard exists only once complete


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        log.setLevel(level)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)
