"""Batches of regenerated sequences: length-bucketed, padded, reproducible per epoch; and
the held-out split.

An epoch's plan depends only on (seed, epoch, the sequence lengths), so a resumed run
rebuilds the same plan and skips the batches it already trained on. Sequences are
shuffled, sorted by length inside windows of `_WINDOW` (so a batch pads little), cut into
batches whose padded size B * T_max stays within `batch_tokens` (and B within
`batch_size` when given), and the batches are shuffled again.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from specserve.train.regen import Sequence

_WINDOW = 1024  # sequences sorted together


@dataclass(frozen=True)
class Batch:
    ids: torch.Tensor  # [B, T] int64, 0 after each sequence's end
    lengths: torch.Tensor  # [B] int64
    prompt_lens: torch.Tensor  # [B] int64

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


def plan_epoch(lengths: list[int], batch_tokens: int, batch_size: int | None, seed: int,
               epoch: int) -> list[list[int]]:
    """Lists of sequence indices, one per batch (module docstring)."""
    rng = random.Random(f"{seed}:{epoch}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches: list[list[int]] = []
    for w in range(0, len(order), _WINDOW):
        window = sorted(order[w:w + _WINDOW], key=lambda i: lengths[i])
        batches += _cut(window, lengths, batch_tokens, batch_size)
    rng.shuffle(batches)
    return batches


def _cut(indices: list[int], lengths: list[int], batch_tokens: int, batch_size: int | None) -> list[list[int]]:
    """Greedy cut of length-sorted indices; a sequence over the budget is a batch alone."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in indices:
        longest_with = max(longest, lengths[i])
        full = batch_size is not None and len(current) >= batch_size
        if current and (full or (len(current) + 1) * longest_with > batch_tokens):
            batches.append(current)
            current, longest_with = [], lengths[i]
        current.append(i)
        longest = longest_with
    if current:
        batches.append(current)
    return batches


def collate(seqs: list[Sequence], device: torch.device) -> Batch:
    lengths = torch.tensor([s.ids.numel() for s in seqs])
    ids = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.int64)
    for b, s in enumerate(seqs):
        ids[b, :s.ids.numel()] = s.ids
    prompt_lens = torch.tensor([s.prompt_len for s in seqs])
    return Batch(ids.to(device), lengths.to(device), prompt_lens.to(device))


def split_validation(seqs: list[Sequence], size: int | None, seed: int) -> tuple[list[Sequence], list[Sequence]]:
    """(train, held out): about `size` sequences (None: 2%, at most 64) held out, chosen as
    whole prompts in a seeded order, so no answer to a held-out prompt is trained on (a
    prompt regenerated at several temperatures has several). With one answer per prompt
    this is a seeded choice of `size` sequences."""
    if size is None:
        size = min(64, len(seqs) // 50)
    if size >= len(seqs):
        raise ValueError(f"cannot hold out {size} of {len(seqs)} sequences")
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(seqs):
        groups.setdefault(tuple(s.ids[:s.prompt_len].tolist()), []).append(i)
    members = list(groups.values())
    held: set[int] = set()
    for g in torch.randperm(len(members), generator=torch.Generator().manual_seed(seed)).tolist():
        if len(held) >= size:
            break
        held.update(members[g])
    if len(held) >= len(seqs):
        raise ValueError(f"cannot hold out {size} of {len(seqs)} sequences and keep a prompt to train on")
    return [s for i, s in enumerate(seqs) if i not in held], [seqs[i] for i in sorted(held)]
