"""On-policy answers: the target regenerates every training answer through `Engine`.

A draft head is scored on the target's own continuations, so it is trained on them: each
prompt (chat template applied) is answered by the target itself, greedy by default. The
results are token-id shards in the output directory:

    <out>/regen.json           the settings the shards were made with (+ the EOS ids)
    <out>/prompts.jsonl        the chosen prompts, in shard order
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
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from tqdm import tqdm

from specserve.train.data import load_prompts

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


@dataclass(frozen=True)
class Sequence:
    ids: torch.Tensor  # [n] int64: prompt then answer
    prompt_len: int

    @property
    def answer_len(self) -> int:
        return self.ids.numel() - self.prompt_len


EngineFactory = Callable[[], Any]  # () -> specserve.Engine, built only when a shard is missing


def regenerate(out: Path, cfg: RegenConfig, make_engine: EngineFactory) -> list[int]:
    """Make every missing shard of `out`; returns the EOS ids of the target's tokenizer."""
    out = Path(out)
    (out / SHARDS).mkdir(parents=True, exist_ok=True)
    meta = _check_meta(out, cfg)
    engine = None
    if meta is None or not (out / PROMPTS).is_file():
        engine = make_engine()
        prompts = choose_prompts(load_prompts(cfg.dataset), engine.tokenizer, cfg)
        _write_jsonl(out / PROMPTS, prompts)
        meta = dataclasses.asdict(cfg) | {"eos_ids": sorted(engine.tokenizer.eos_token_ids)}
        (out / META).write_text(json.dumps(meta, indent=2))
    prompts = [json.loads(line) for line in (out / PROMPTS).read_text().splitlines()]
    chunks = [prompts[i:i + cfg.shard_size] for i in range(0, len(prompts), cfg.shard_size)]
    todo = [k for k in range(len(chunks)) if not shard_path(out, k).is_file()]
    if todo:
        engine = engine or make_engine()
        with _quiet("specserve"):  # the engine's per-batch log lines; the progress bar says enough
            _generate_shards(out, engine, chunks, todo, cfg)
    return meta["eos_ids"]


def choose_prompts(texts: list[str], tokenizer: Any, cfg: RegenConfig) -> list[dict]:
    """Up to num_prompts prompts in a seeded random order, chat-templated, keeping those
    whose ids fit in half of max_seq_len (the other half is room for the answer)."""
    order = list(range(len(texts)))
    random.Random(cfg.seed).shuffle(order)
    chosen = []
    for i in order:
        if len(chosen) == cfg.num_prompts:
            break
        ids = tokenizer.encode_chat([{"role": "user", "content": texts[i]}])
        if 0 < len(ids) <= cfg.max_seq_len // 2:
            chosen.append({"text": texts[i], "ids": ids})
    if not chosen:
        raise ValueError(f"no prompt of {cfg.dataset!r} fits --max-seq-len {cfg.max_seq_len}")
    return chosen


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
    wanted = dataclasses.asdict(cfg)
    diff = {k: (meta.get(k), v) for k, v in wanted.items() if meta.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in diff.items())
        raise ValueError(f"{out} holds answers regenerated with other settings ({detail}): "
                         "use a fresh --output directory or the same settings")
    return meta


def _generate_shards(out: Path, engine: Any, chunks: list[list[dict]], todo: list[int],
                     cfg: RegenConfig) -> None:
    bar = tqdm(total=len(chunks), initial=len(chunks) - len(todo), desc="regenerate", unit="shard")
    made, start = 0, time.perf_counter()
    for k in todo:
        ids = [p["ids"] for p in chunks[k]]
        params = [{"temperature": cfg.temperature,
                   "max_new_tokens": max(1, min(cfg.max_new_tokens, cfg.max_seq_len - len(p)))} for p in ids]
        answers = [o["output_ids"] for o in engine.generate(input_ids=ids, sampling_params=params)]
        _save_shard(shard_path(out, k), ids, answers)
        made += sum(len(a) for a in answers)
        bar.update(1)
        bar.set_postfix(gen_tok_s=f"{made / (time.perf_counter() - start):.0f}")
    bar.close()


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
