"""Which NGRAM drafts are worth verifying: a gate on the length of the match a draft rests on.

A draft is only as good as the history it matched: a match of one token (the common case,
min window 1) rarely gains a token a verify, a match of several tokens often gains many
(docs/benchmarks.md). Where a verify of a full tree costs little more than a decode (a GPU
at batch 1) most drafts pay; where it costs several decodes (a CPU, whose verify costs its
tokens), only the long matches do.

So the gate keeps, per match length (lengths from CAP up share one bucket), the mean tokens
a verify committed when drafted from such a match (decayed: recent verifies weigh most),
and leaves out a draft whose bucket's mean is below the price of a speculative step in
plain steps (`price`, the governor's measurement, set before each proposal at batch 1;
None, as above batch 1: every draft goes). A bucket it has no verify of yet is drafted;
one it leaves out is drafted anyway every EXPLORE-th time, so its mean follows the text.
Leaving a draft out changes no output: the request's step is a decode. Before each decode
step at batch 1 the proposer also tells the governor whether the expected tokens
(`expected`) pay for a speculative step at the price (its hint, governor.py): a step whose
match would not pay is a plain step.
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

    def expected(self, length: int) -> float:
        """Tokens a speculative step is expected to commit for a request whose match is
        `length` tokens long: its bucket's mean where drafting from it pays; 1 where the
        gate leaves the draft out (a decode); the price itself for a bucket never drafted
        from (break-even: a step that needs it is taken, and measures it)."""
        mean = self.mean(length)
        if length == 0 or self.price is None:
            return 1.0
        if mean is None:
            return self.price
        return mean if mean >= self.price else 1.0

    def record(self, length: int, committed: int) -> None:
        """A verify drafted from a match of `length` tokens committed `committed` tokens."""
        b = min(length, CAP)
        total, weight = self._mean.get(b, (0.0, 0.0))
        self._mean[b] = (total * self.decay + committed, weight * self.decay + 1.0)

    def mean(self, length: int) -> float | None:
        """The mean tokens a verify drafted from such a match committed (None: none yet)."""
        total, weight = self._mean.get(min(length, CAP), (0.0, 0.0))
        return total / weight if weight else None
