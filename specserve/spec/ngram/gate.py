"""Which NGRAM drafts are worth verifying: a gate on the length of the match a draft rests on.

A draft is only as good as the history it matched: on the repeat-and-edit set and MT-bench,
a match of one token (the common case, min window 1) gained about half a token a verify
with SmolLM2, a match of four or more several tokens. Where a verify of a full tree costs
little more than a decode (a GPU at batch 1) every draft pays; where it costs several
decodes (a CPU, whose verify costs its tokens), only the long matches do.

So the gate keeps, per match length (lengths from CAP up share one bucket), the mean
tokens a verify committed when drafted from such a match (decayed: recent verifies weigh
most), and leaves out a draft whose bucket's mean is below the price of a speculative step
in plain steps (`price`, the governor's measurement, set before each proposal; None: every
draft goes). A bucket it has no verify of yet is drafted; one it leaves out is drafted
anyway every EXPLORE-th time, so its mean follows the text. Leaving a draft out changes no
output: the request's step is a decode. Before each decode step `pays` tells the governor
whether any request's match would pay (its hint, governor.py): a step where none would is
a plain step.
"""
from __future__ import annotations

CAP = 8  # matches this long or longer share a bucket
EXPLORE = 32  # a bucket left out is drafted every EXPLORE-th time
DECAY = 0.9  # the weight of a bucket's older verifies, per newer one


class MatchGate:
    def __init__(self, explore: int = EXPLORE, decay: float = DECAY) -> None:
        self.price: float | None = None
        self.explore, self.decay = explore, decay
        self._mean: dict[int, tuple[float, float]] = {}  # bucket -> (decayed sum of tokens, of weights)
        self._left_out: dict[int, int] = {}  # bucket -> drafts left out since it was last drafted

    def allows(self, length: int) -> bool:
        """Whether to draft from a match of `length` tokens (0: no match, nothing to draft)."""
        b = min(length, CAP)
        if length == 0 or self.price is None or b not in self._mean:
            return length > 0
        total, weight = self._mean[b]
        if total / weight >= self.price:
            return True
        n = self._left_out.get(b, 0) + 1
        self._left_out[b] = 0 if n >= self.explore else n
        return n >= self.explore

    def pays(self, length: int) -> bool:
        """Whether a draft from a match of `length` tokens is expected to pay at `price` (a
        length never drafted from: yes, so that it is measured); no exploration counted."""
        mean = self.mean(length)
        return length > 0 and (self.price is None or mean is None or mean >= self.price)

    def record(self, length: int, committed: int) -> None:
        """A verify drafted from a match of `length` tokens committed `committed` tokens."""
        b = min(length, CAP)
        total, weight = self._mean.get(b, (0.0, 0.0))
        self._mean[b] = (total * self.decay + committed, weight * self.decay + 1.0)

    def mean(self, length: int) -> float | None:
        """The mean tokens a verify drafted from such a match committed (None: none yet)."""
        total, weight = self._mean.get(min(length, CAP), (0.0, 0.0))
        return total / weight if weight else None
