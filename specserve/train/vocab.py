"""EAGLE-3's draft vocabulary: which target token ids the head can propose.

The N most frequent tokens of the regenerated answers (the tokens the head will be asked
to predict), EOS ids always in, ties broken by the lower id, unseen ids filling the tail
when the answers have fewer than N distinct tokens. Stored the published way: `ids`
sorted ascending, `d2t[i] = ids[i] - i` (offsets: target id = i + d2t[i]) and
`t2d` [V] bool (membership). Knows nothing about models or checkpoints.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from specserve.train.regen import Sequence


@dataclass(frozen=True)
class DraftVocab:
    ids: torch.Tensor  # [N] int64 target ids, strictly increasing
    target_vocab: int  # V

    @property
    def size(self) -> int:
        return self.ids.numel()

    @property
    def d2t(self) -> torch.Tensor:
        """[N] int64 offsets: draft index i is target id i + d2t[i]."""
        return self.ids - torch.arange(self.size)

    @property
    def t2d(self) -> torch.Tensor:
        """[V] bool: which target ids are in the draft vocabulary."""
        mask = torch.zeros(self.target_vocab, dtype=torch.bool)
        mask[self.ids] = True
        return mask

    def coverage(self, counts: torch.Tensor) -> float:
        """The fraction of counted tokens (counts [V]) the vocabulary covers."""
        return float(counts[self.ids].sum() / counts.sum().clamp(min=1))


def answer_token_counts(seqs: list[Sequence], target_vocab: int) -> torch.Tensor:
    """[V] int64: how often each id appears in the answers (prompt tokens are not drafted)."""
    answers = torch.cat([s.ids[s.prompt_len:] for s in seqs]) if seqs else torch.zeros(0, dtype=torch.int64)
    return torch.bincount(answers, minlength=target_vocab)


def build_draft_vocab(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> DraftVocab:
    """The `min(size, V)` ids ranked by (forced first, count descending, id ascending)."""
    vocab = counts.numel()
    size = min(size, vocab)
    if size < 1:
        raise ValueError(f"draft vocabulary size must be positive, got {size}")
    order = torch.sort(-counts, stable=True).indices  # count desc; stable keeps ids ascending
    forced = torch.tensor(sorted({t for t in always if 0 <= t < vocab}), dtype=torch.int64)
    if forced.numel():
        order = torch.cat([forced, order[~torch.isin(order, forced)]])
    return DraftVocab(order[:size].sort().values, vocab)


def vocab_from_d2t(d2t: torch.Tensor, target_vocab: int) -> DraftVocab:
    """The inverse of `DraftVocab.d2t` (reading a vocabulary back from a checkpoint)."""
    return DraftVocab(d2t.long() + torch.arange(d2t.numel()), target_vocab)
