"""One request's grammar matcher: token masks at its state and along draft paths.

A mask is the llguidance bitmask: int32 words, bit t % 32 of word t // 32 set when token t
is allowed. `sync(output_ids)` advances the matcher over tokens committed since the last
call (every commit path, plain or speculative, only appends to output_ids, so the matcher
follows it lazily and no caller must remember to advance it).

`tree_masks` gives each node of a draft tree the mask after the tokens of its own path
(root excluded: the root is the last committed token): it consumes a node's token only
when the node's parent mask allows it, takes the mask, and rolls back to the committed
state at the end. A node whose token the grammar forbids at its parent is dead: its row
allows everything, which is harmless because the target's masked logit of that token at
the parent is -inf, so no acceptance rule can take it.

EOS never advances a matcher: an EOS the grammar allows (it is in an accepting state)
ends a request, and with ignore_eos the grammar stays where it was. (llguidance keeps no
EOS in its token history, so a rollback over one would undo a real token as well.)

Invariants: outside a call the matcher sits exactly at the committed output; it never
consumes a token it did not first find allowed (llguidance cannot leave an error state).
Should llguidance still fail (a parser limit hit mid-output), the matcher records the
error, stops advancing and allows EOS alone from then on: the request ends, the engine
does not.
"""
from __future__ import annotations

import llguidance
import torch


def _bit(k: int) -> int:
    """Bit k of an int32 word, as a Python int in int32's range (bit 31 is negative)."""
    return -(1 << 31) if k == 31 else 1 << k


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allows(mask: torch.Tensor, token: int) -> bool:
    """Whether the bitmask `mask` [W] int32 allows `token`."""
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


class GrammarMatcher:
    def __init__(self, ll: llguidance.LLMatcher, vocab_size: int, eos_ids: list[int]) -> None:
        self.ll, self.vocab_size, self.eos_ids = ll, vocab_size, eos_ids
        self.words = mask_words(vocab_size)
        self.consumed = 0  # output tokens consumed so far
        self.error: str | None = None

    def sync(self, output_ids: list[int]) -> None:
        """Consume the output tokens committed since the last call."""
        for tok in output_ids[self.consumed:]:
            if self.error is not None or not self._consume(tok):
                return
            self.consumed += 1

    def mask(self) -> torch.Tensor:
        """[W] int32 bitmask of the tokens allowed next (EOS alone after an error)."""
        out = torch.zeros(self.words, dtype=torch.int32)
        if self.error is None:
            self._fill(out)
        else:
            for tok in self.eos_ids:
                out[tok // 32] |= _bit(tok % 32)
        return out

    def greedy_walk_allowed(self, top: list[int], tokens: list[int] | None = None,
                            parents: list[int] | None = None, valid: list[bool] | None = None) -> bool:
        """Whether the mask allows the unmasked argmax `top[i]` at every node a greedy walk
        reaches: the root and, while the argmax is drafted, the first valid child carrying
        it. Then masking changes none of the argmaxes the walk reads, and a greedy request
        needs no mask applied. The masks are computed at those nodes alone (about the
        accept length), not at every node of the tree. No tree: the root alone."""
        if self.error is not None:
            return False
        row = torch.zeros(self.words, dtype=torch.int32)
        node, ok = 0, True
        path: list[int] = []
        while True:
            self._fill(row)
            if not allows(row, top[node]):
                ok = False
                break
            child = _child_with(node, top[node], tokens, parents, valid) if tokens is not None else None
            if child is None or not self._move_to(path, path + [child], tokens or []):
                break
            node = child
        self._rollback(self._advancing(path, tokens or []))
        return ok and self.error is None

    def tree_masks(self, tokens: list[int], parents: list[int], valid: list[bool]) -> torch.Tensor:
        """[N, W] int32: row i the mask after node i's path (node 0 the root). Parents come
        before their children (the Drafts contract), so one pass in node order suffices."""
        n = len(tokens)
        out = torch.full((n, self.words), -1, dtype=torch.int32)  # dead nodes: everything
        if self.error is not None:
            out[0] = self.mask()
            return out
        alive = [False] * n
        path: list[int] = []  # nodes consumed beyond the committed state, root-first
        for i in range(n):
            if i > 0:
                p = parents[i]
                if not valid[i] or not alive[p] or not allows(out[p], tokens[i]):
                    continue
                if not self._move_to(path, _chain(p, parents) + [i], tokens):
                    break
            alive[i] = True
            self._fill(out[i])
        self._rollback(self._advancing(path, tokens))
        return out

    def _move_to(self, path: list[int], chain: list[int], tokens: list[int]) -> bool:
        """Make the consumed path `chain` (root-excluded, root-first): roll back to the
        common prefix, consume the rest (each found allowed before). False if llguidance
        failed (recorded in `error`; the path is then rolled back whole)."""
        keep = 0
        while keep < min(len(path), len(chain)) and path[keep] == chain[keep]:
            keep += 1
        self._rollback(self._advancing(path[keep:], tokens))
        del path[keep:]
        for node in chain[keep:]:
            if not self._consume(tokens[node]):
                return False
            path.append(node)
        return True

    def _advancing(self, nodes: list[int], tokens: list[int]) -> int:
        """How many of `nodes` advanced the matcher (all but EOS nodes)."""
        return sum(tokens[i] not in self.eos_ids for i in nodes)

    def _consume(self, tok: int) -> bool:
        """Advance over `tok` (EOS: stay; see the module docstring)."""
        if tok in self.eos_ids:
            return True
        if self.ll.consume_token(tok):
            return True
        self.error = f"token {tok} refused: {self.ll.get_error().splitlines()[0]}"
        return False

    def _rollback(self, k: int) -> None:
        if k and self.error is None and not self.ll.rollback(k):
            self.error = f"rollback of {k} tokens failed: {self.ll.get_error().splitlines()[0]}"

    def _fill(self, row: torch.Tensor) -> None:
        self.ll.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


def _chain(node: int, parents: list[int]) -> list[int]:
    """`node` and its ancestors below the root, root-first ([] for the root)."""
    chain = []
    while node > 0:
        chain.append(node)
        node = parents[node]
    return chain[::-1]


def _child_with(node: int, token: int, tokens: list[int], parents: list[int] | None,
                valid: list[bool] | None) -> int | None:
    """The first valid child of `node` (node order) carrying `token`: where the greedy walk goes."""
    assert parents is not None and valid is not None, "a tree comes with its parents and validity"
    for j in range(node + 1, len(tokens)):
        if parents[j] == node and valid[j] and tokens[j] == token:
            return j
    return None
