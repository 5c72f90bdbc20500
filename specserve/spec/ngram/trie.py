"""The n-gram trie behind NGRAM drafting: one global token trie shared by all requests.

Owns the nodes, their counts and recency, and LRU eviction at `capacity`. It knows nothing
about requests or draft trees: `NgramProposer` (ngram.py) keeps each request's anchors and
turns matches into `Drafts`.

A path root -> n1 -> ... -> nk spells an n-gram (tok[n1], ..., tok[nk]) of length k <=
`branch_length`; `freq[n]` is how many times it occurred in the indexed text (prompts and
committed tokens of every request). `kids[n]` maps token -> child in recency order: a touched
child is re-inserted, so the most recent is last (BFS reads `reversed(kids[n].items())`).

Layout: nodes are int ids into parallel lists, `kids` are dicts of ints. CPython's cyclic GC
does not track such dicts, so a trie of millions of nodes costs the collector nothing (one
object per node with parent pointers made insertion ~5x slower through GC passes). An evicted
id goes to a free list for reuse and `ver[id]` is bumped, so holders of (id, ver) notice.

Insertion is incremental (SGLang re-walks the last `branch_length` tokens from the root on
every step): a request's *anchors* are the nodes of its last 1, 2, ... tokens, and a new token
t extends anchor d into the (d+1)-gram ending at t. Each new token costs `branch_length` dict
steps, whatever the history length, and every n-gram occurrence is counted exactly once.

Eviction (SGLang squeezes the tail of a global LRU list in which parents are always spliced in
front of their children): we evict the leaf with the oldest `stamp` (the token counter at its
last occurrence). A node's effective recency is the newest stamp in its subtree, so a parent
is never older than its children; we materialise that lazily by copying an evicted leaf's
stamp to its parent. The LRU is a dict stamp -> FIFO of leaves, built at the first eviction
(so a trie that never fills pays nothing) and read from the oldest stamp up; it holds at most
one entry per node, dropped when found to have children and re-filed when found stale.
Capacity must hold the n-grams of one token (`min_capacity`), so eviction never takes what
is being written; it runs in batches of up to 256 below capacity.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence

ROOT = 0


def min_capacity(branch_length: int) -> int:
    """Nodes that the n-grams ending at one token may need (all distinct paths): with at least
    this many, eviction always finds an older leaf than the ones being written."""
    return branch_length * (branch_length + 1) // 2


class NgramTrie:
    def __init__(self, branch_length: int, capacity: int) -> None:
        assert capacity >= min_capacity(branch_length), (capacity, branch_length)
        self.branch_length = branch_length  # longest n-gram stored
        self.capacity = capacity  # non-root nodes
        self.tok: list[int] = [-1]
        self.par: list[int] = [-1]  # -1: the root, or a free id
        self.kids: list[dict[int, int]] = [{}]
        self.freq: list[int] = [0]
        self.stamp: list[int] = [0]
        self.ver: list[int] = [0]  # bumped when the id is freed
        self.in_lru: list[bool] = [False]  # has an entry in _lru (at most one)
        self.free: list[int] = []
        self.size = 0
        self.evicted = 0
        self.tick = 0
        self._lru: dict[int, deque[int]] | None = None  # stamp -> leaves, built at first eviction
        self._oldest = 0  # no leaf is older: the stamp evicted next
        # Evict in batches down to capacity - slack (the per-call overhead dominates otherwise).
        self._slack = min(256, (capacity - min_capacity(branch_length)) // 64)

    # ---- insertion --------------------------------------------------------------------------

    def extend(self, anchors: list[int], vers: list[int], recent: Sequence[int],
               token: int) -> tuple[list[int], list[int]]:
        """Count every n-gram ending at `token`; return the new (anchors, vers).

        anchors[d-1] is the node of recent[-d:] (the tokens before `token`) as of version
        vers[d-1], d = 1..len(anchors) <= branch_length - 1; the result is the same for
        recent + [token]. An anchor evicted since is rebuilt from `recent` (count restarts at 1).
        """
        kids, freq, stamps, ver = self.kids, self.freq, self.stamp, self.ver
        self.tick += 1
        stamp = self.tick
        depth = len(anchors)
        new = [0] * (depth + 1)  # new[d]: the (d+1)-gram ending at `token`
        new_vers = [0] * (depth + 1)
        for d in range(depth, -1, -1):  # longest first (eviction order depends on it)
            a = anchors[d - 1] if d else ROOT
            if d and ver[a] != vers[d - 1]:
                a = self._restore(list(recent)[-d:], stamp)
            k = kids[a]
            c = k.pop(token, -1)
            if c < 0:
                c = self._new(a, token, stamp)
            else:
                freq[c] += 1
                stamps[c] = stamp
                k[token] = c  # re-inserted: now the most recent child
            new[d] = c
            new_vers[d] = ver[c]
        if depth + 1 == self.branch_length:  # a full-length n-gram is never extended
            new.pop()
            new_vers.pop()
        return new, new_vers

    def _new(self, parent: int, token: int, stamp: int) -> int:
        """A new leaf `token` under `parent`; may evict others (never `parent`: it has a child)."""
        if self.free:
            c = self.free.pop()
            self.tok[c], self.par[c], self.freq[c], self.stamp[c] = token, parent, 1, stamp
        else:
            c = len(self.tok)
            self.tok.append(token)
            self.par.append(parent)
            self.kids.append({})
            self.freq.append(1)
            self.stamp.append(stamp)
            self.ver.append(0)
            self.in_lru.append(False)
        self.kids[parent][token] = c
        self.size += 1
        if self._lru is not None:
            self._push(c)
        if self.size > self.capacity:
            self._evict(self.size - self.capacity + self._slack)
        return c

    def _restore(self, tokens: Sequence[int], stamp: int) -> int:
        """The node of `tokens`, creating missing nodes (freq 1) without counting the others."""
        node = ROOT
        for t in tokens:
            child = self.kids[node].get(t, -1)
            node = child if child >= 0 else self._new(node, t, stamp)
        return node

    # ---- eviction ---------------------------------------------------------------------------

    def _push(self, node: int) -> None:
        assert self._lru is not None, "pushed once eviction has built the LRU"
        self.in_lru[node] = True
        bucket = self._lru.get(self.stamp[node])
        if bucket is None:
            self._lru[self.stamp[node]] = deque((node,))
        else:
            bucket.append(node)

    def _evict(self, count: int) -> None:
        """Evict `count` least recently used leaves (first in, first out within one stamp)."""
        if self._lru is None:  # first eviction: index the current leaves
            self._lru = {}
            for n in sorted(self.nodes(), key=self.stamp.__getitem__):
                if not self.kids[n]:
                    self._push(n)
            self._oldest = min(self._lru)
        lru, kids, stamps, par, tok, in_lru = (self._lru, self.kids, self.stamp, self.par,
                                               self.tok, self.in_lru)
        oldest = self._oldest
        for _ in range(count):
            while True:
                bucket = lru.get(oldest)
                if not bucket:  # every push is at a stamp >= oldest: it only moves forward
                    lru.pop(oldest, None)
                    oldest += 1
                    continue
                node = bucket.popleft()
                in_lru[node] = False
                if kids[node]:
                    continue  # it gained children: pushed again once it is a leaf again
                if stamps[node] != oldest:
                    self._push(node)  # touched since it was pushed
                    continue
                break
            parent = par[node]
            del kids[parent][tok[node]]
            par[node] = -1
            self.ver[node] += 1
            self.free.append(node)
            if parent != ROOT:  # never older than the children it had
                if stamps[parent] < oldest:
                    stamps[parent] = oldest
                if not kids[parent] and not in_lru[parent]:
                    self._push(parent)
        self._oldest = oldest
        self.size -= count
        self.evicted += count

    # ---- lookup and inspection --------------------------------------------------------------

    def find(self, tokens: Sequence[int]) -> int | None:
        """The node spelling `tokens`, or None (read-only: touches nothing)."""
        node = ROOT
        for t in tokens:
            node = self.kids[node].get(t, -1)
            if node < 0:
                return None
        return node

    def nodes(self) -> Iterator[int]:
        """Every live non-root node, parents before children."""
        stack = list(self.kids[ROOT].values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(self.kids[node].values())
