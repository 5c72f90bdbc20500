"""NGRAM proposer: parameter checks, exact drafts, BFS vs PROB, prompt lookup, budgets,
eviction, and equality with a from-scratch reference of SGLang's matching on random histories."""
from __future__ import annotations

import gc
import heapq
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.spec.drafts import Drafts
from specserve.spec.ngram.proposer import NgramProposer, _drafts

SMALL = dict(min_window=1, max_window=3, min_bfs_breadth=1, max_bfs_breadth=4, branch_length=6,
             capacity=10_000, num_draft_tokens=8)


def make(match_type: str = "BFS", **kw) -> NgramProposer:
    return NgramProposer(**{**SMALL, "match_type": match_type, **kw})


def tree(ngram: NgramProposer, rid: str, root: int, budget: int | None = None) -> tuple[list, list]:
    d = ngram.propose([rid], [root], None if budget is None else [budget])
    n = int(d.valid[0].sum())
    return d.tokens[0, :n].tolist(), d.parents[0, :n].tolist()


# ---- parameters -------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, match", [
    (dict(branch_length=1, max_window=0, min_window=0), "branch_length must be > 1"),
    (dict(min_window=0), "min_window must be > 0"),
    (dict(min_window=4, max_window=3), r"min_window \(4\) must be <= max_window \(3\)"),
    (dict(max_window=6), r"max_window \(6\) must be < branch_length \(6\)"),
    (dict(min_bfs_breadth=0), "min_bfs_breadth must be > 0"),
    (dict(min_bfs_breadth=5, max_bfs_breadth=4), r"min_bfs_breadth \(5\) must be <= max_bfs"),
    (dict(num_draft_tokens=0), "num_draft_tokens must be > 0"),
    (dict(capacity=20), r"capacity \(20\) must be >= .* = 21"),
    (dict(match_type="LRU"), "match_type must be BFS or PROB"),
])
def test_parameter_checks(bad, match):
    with pytest.raises(ValueError, match=match):
        NgramProposer(**{**SMALL, "match_type": "BFS", **bad})


def test_match_type_is_case_insensitive_and_both_are_used():
    assert make("prob").match_type == "PROB"
    assert make("bfs").match_type == "BFS"


# ---- exact drafts -----------------------------------------------------------------------------

def test_repeat_drafts_its_continuation_as_a_chain():
    ng = make()
    ng.add_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3])
    # [1 2 3] continues with 4 5 6 (trie depth 6); shorter matches extend it with 7 and 8
    assert tree(ng, "a", 3) == ([3, 4, 5, 6, 7, 8], [-1, 0, 1, 2, 3, 4])
    assert tree(ng, "a", 3, budget=3) == ([3, 4, 5], [-1, 0, 1])
    assert tree(ng, "a", 3, budget=1) == ([3], [-1])


# History for the branch tests: after [1 2 3], 4 came twice, then 7 once (most recently).
BRANCHY = [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 9, 1, 2, 3]


def test_branch_bfs_puts_the_most_recent_continuation_first():
    ng = make("BFS")
    ng.add_request("a", BRANCHY)
    # d=3 (breadth 1): the chain 7 8 9; d=2 (breadth 2): 7 again (merged) and 4, then one
    # child per level: 5 9 below 4, and 1 below the first 9 (from [2 3 7 8 9 1])
    assert tree(ng, "a", 3) == ([3, 7, 8, 9, 4, 5, 9, 1], [-1, 0, 1, 2, 0, 4, 5, 3])


def test_branch_prob_puts_the_most_frequent_continuation_first():
    ng = make("PROB")
    ng.add_request("a", BRANCHY)
    # p(4) = 2/3 and its chain 5 9 keeps 2/3, then p(7) = 1/3 with 8 9; d=2 merges into the
    # same nodes and adds the 1 that followed [2 3 4 5 9]
    assert tree(ng, "a", 3) == ([3, 4, 5, 9, 7, 8, 9, 1], [-1, 0, 1, 2, 0, 4, 5, 3])


def test_bfs_and_prob_differ_where_recency_and_frequency_disagree():
    trees = []
    for match_type in ("BFS", "PROB"):
        ng = make(match_type)
        ng.add_request("a", BRANCHY)
        trees.append(tree(ng, "a", 3))
    assert trees[0] != trees[1]
    assert trees[0][0][1] == 7 and trees[1][0][1] == 4  # first child: recency vs frequency


def test_bfs_breadth_schedule():
    # scale = (4 - 1) / (3 - 1 + 1) = 1: a length-1 match starts at breadth (3 - 1) + 1 = 3
    ng = make("BFS", num_draft_tokens=8)
    ng.add_request("a", [5, 10, 11, 5, 20, 21, 5, 30, 31, 5, 40, 41, 99, 5])
    # only [5] matches; breadth 3 takes 40, 30, 20 (most recent first, not 10), then 2, then 1
    assert tree(ng, "a", 5) == ([5, 40, 30, 20, 41, 31, 21, 99], [-1, 0, 0, 0, 1, 2, 3, 4])


def test_prob_normalises_over_top_max_bfs_children():
    ng = make("PROB", max_bfs_breadth=2)
    ng.add_request("a", [5, 1, 5, 1, 5, 1, 5, 2, 5, 2, 5, 3, 7, 5])
    toks, pars = tree(ng, "a", 5)
    # after 5 came 1 (x3), 2 (x2), 3 (x1): only the top-2 are candidates, most frequent first
    assert [t for t, p in zip(toks, pars) if p == 0] == [1, 2] and len(toks) == 8


def test_prompt_is_indexed_and_proposed_on_first_repetition():
    ng = make()
    prompt = [50, 60, 70, 80, 90, 100, 51, 52]
    ng.add_request("a", prompt)
    ng.on_tokens("a", [60])
    assert tree(ng, "a", 60)[0] == [60, 70, 80, 90, 100, 51]
    # the trie is global: another request repeating the prompt gets the same continuation
    ng.add_request("b", [1, 2, 70])
    assert tree(ng, "b", 70)[0][:4] == [70, 80, 90, 100]


def test_no_match_gives_a_root_only_row_padded_in_the_batch():
    ng = make()
    ng.add_request("a", [1, 2, 3, 1, 2])
    ng.add_request("b", [7, 8, 9])
    d = ng.propose(["a", "b"], [2, 9])
    assert d.valid.tolist() == [[True] * 4, [True, False, False, False]]
    assert d.tokens.tolist() == [[2, 3, 1, 2], [9, 0, 0, 0]]
    assert d.parents.tolist() == [[-1, 0, 1, 2], [-1, 0, 0, 0]]


def test_root_and_budget_are_checked():
    ng = make()
    ng.add_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="not its last token"):
        ng.propose(["a"], [2])
    with pytest.raises(ValueError, match="budget"):
        ng.propose(["a"], [3], [0])
    with pytest.raises(ValueError, match="budget"):
        ng.propose(["a"], [3], [9])
    with pytest.raises(ValueError, match="already registered"):
        ng.add_request("a", [])


def test_remove_request_forgets_the_request_but_not_the_trie():
    ng = make()
    ng.add_request("a", [1, 2, 3, 4, 5])
    ng.remove_request("a")
    with pytest.raises(KeyError):
        ng.propose(["a"], [5])
    ng.remove_request("a")  # idempotent
    ng.add_request("a", [9, 3])  # the id can come back (a retracted request resumes)
    assert tree(ng, "a", 3)[0] == [3, 4, 5]


# ---- counts, trees and a reference ------------------------------------------------------------

class Reference:
    """SGLang's matching written the slow, obvious way over explicit n-gram statistics:
    count[g] = occurrences of n-gram g (len <= branch_length), last[g] = when it last ended."""

    def __init__(self, ng: NgramProposer) -> None:
        self.ng, self.count, self.last, self.clock = ng, Counter(), {}, 0
        self.hist: dict[str, list[int]] = {}

    def feed(self, rid: str, tokens: list[int]) -> None:
        h = self.hist.setdefault(rid, [])
        for t in tokens:
            h.append(t)
            self.clock += 1
            for n in range(1, min(len(h), self.ng.trie.branch_length) + 1):
                self.count[tuple(h[-n:])] += 1
                self.last[tuple(h[-n:])] = self.clock

    def kids(self, g: tuple) -> list[tuple]:  # most recent first
        return sorted((c for c in self.count if len(c) == len(g) + 1 and c[:-1] == g),
                      key=lambda c: -self.last[c])

    def matches(self, rid: str) -> list[tuple[tuple, int]]:
        h, ng = self.hist[rid], self.ng
        return [(tuple(h[-d:]), d) for d in range(min(ng.max_window, len(h)), ng.min_window - 1, -1)
                if self.kids(tuple(h[-d:]))]

    def bfs(self, rid: str, budget: int) -> list[list[int]]:
        ng, nodes = self.ng, [[self.hist[rid][-1], -1]]  # [token, parent]
        for g, d in self.matches(rid):
            queue = [(0, (ng.max_window - d) * ng.bfs_scale + ng.min_bfs, g)]
            while queue and len(nodes) < budget:
                pos, breadth, g = queue.pop(0)
                for c in self.kids(g)[:max(1, int(breadth))]:
                    i = next((j for j, (t, p) in enumerate(nodes) if p == pos and t == c[-1]), None)
                    if i is None:
                        if len(nodes) >= budget:
                            break
                        i = len(nodes)
                        nodes.append([c[-1], pos])
                    queue.append((i, breadth - ng.bfs_scale, c))
        return nodes

    def prob(self, rid: str, budget: int) -> list[list[int]]:
        nodes, heap, seq = [[self.hist[rid][-1], -1]], [], 0

        def add(pos: int, g: tuple, prob: float) -> None:  # top-max_bfs children, by frequency
            nonlocal seq
            kids = self.kids(g)
            top = sorted(kids, key=lambda c: -self.count[c])[:self.ng.max_bfs]  # ties: recency
            total = sum(self.count[c] for c in top)
            for c in top:  # a single child keeps its parent's probability exactly
                p = prob if len(kids) == 1 else self.count[c] * (prob / total)
                heapq.heappush(heap, (-p, seq, pos, c))
                seq += 1

        for g, _ in self.matches(rid):
            if len(nodes) >= budget:
                break
            add(0, g, 1.0)  # the heap carries over between matches
            while heap and len(nodes) < budget:
                neg, _, pos, c = heapq.heappop(heap)
                i = next((j for j, (t, p) in enumerate(nodes) if p == pos and t == c[-1]), None)
                if i is None:
                    i = len(nodes)
                    nodes.append([c[-1], pos])
                add(i, c, -neg)
        return nodes


def check_tree(d: Drafts, b: int, root: int, budget: int) -> None:
    n = int(d.valid[b].sum())
    assert 1 <= n <= budget and d.valid[b, :n].all() and not d.valid[b, n:].any()
    toks, pars = d.tokens[b, :n].tolist(), d.parents[b, :n].tolist()
    assert toks[0] == root and pars[0] == -1
    assert all(0 <= pars[i] < i for i in range(1, n))
    siblings = [(p, t) for p, t in zip(pars[1:], toks[1:])]
    assert len(set(siblings)) == len(siblings), "a token appears twice among a node's children"


def check_trie(ng: NgramProposer) -> None:
    trie = ng.trie
    live = list(trie.nodes())
    assert len(live) == trie.size <= trie.capacity  # nothing orphaned: no parent was evicted
    for c in live:
        assert trie.kids[trie.par[c]][trie.tok[c]] == c and trie.freq[c] >= 1
    for c in trie.free:
        assert trie.par[c] == -1 and not trie.kids[c]


histories = st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 4), max_size=6)),
                     min_size=1, max_size=25)


@settings(max_examples=40, deadline=None)
@given(histories, st.sampled_from(["BFS", "PROB"]), st.integers(1, 8), st.integers(1, 3))
def test_random_histories_match_the_reference(steps, match_type, budget, min_window):
    ng = make(match_type, min_window=min_window, max_window=max(min_window, 3))
    ref = Reference(ng)
    for rid, tokens in [(f"r{i}", [i]) for i in range(3)] + [(f"r{r}", t) for r, t in steps]:
        if rid not in ng._reqs:
            ng.add_request(rid, tokens)
        else:
            ng.on_tokens(rid, tokens)
        ref.feed(rid, tokens)
        rids = sorted(ref.hist)
        roots = [ref.hist[r][-1] for r in rids]
        d = ng.propose(rids, roots, [budget] * len(rids))
        want_d = Drafts.from_lists(*_lists(d))
        assert torch.equal(d.valid, want_d.valid) and torch.equal(d.parents, want_d.parents)
        for b, r in enumerate(rids):
            check_tree(d, b, roots[b], budget)
            want = ref.bfs(r, budget) if match_type == "BFS" else ref.prob(r, budget)
            n = int(d.valid[b].sum())
            got = zip(d.tokens[b, :n].tolist(), d.parents[b, :n].tolist())
            assert [list(x) for x in got] == want
    for g, n in ref.count.items():  # every n-gram counted exactly once per occurrence
        assert ng.trie.freq[ng.trie.find(g)] == n
    assert ng.trie.size == len(ref.count)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=7), min_size=1, max_size=5),
       st.randoms(use_true_random=False))
def test_batched_drafts_equal_from_lists(token_rows, rnd):
    parents = [[-1] + [rnd.randrange(i) for i in range(1, len(t))] for t in token_rows]
    got, want = _drafts(list(zip(token_rows, parents))), Drafts.from_lists(token_rows, parents)
    for field in ("tokens", "parents", "valid"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field


def test_trie_nodes_are_invisible_to_the_garbage_collector():
    ng = make()
    ng.add_request("a", [random.Random(0).randrange(20) for _ in range(300)])
    assert not any(gc.is_tracked(ng.trie.kids[n]) for n in ng.trie.nodes())


def _lists(d: Drafts) -> tuple[list, list]:
    n = d.valid.sum(1).tolist()
    return ([d.tokens[b, :k].tolist() for b, k in enumerate(n)],
            [d.parents[b, :k].tolist() for b, k in enumerate(n)])


# ---- eviction ---------------------------------------------------------------------------------

def test_eviction_takes_the_least_recently_used_leaf():
    ng = make(branch_length=2, max_window=1, capacity=3)  # min capacity for length 2 is 3
    ng.add_request("a", [1, 2])  # nodes [1], [1 2], [2]
    ng.on_tokens("a", [1])  # [2 1] is new: the oldest leaf [1 2] goes, not [1] (it has kids)
    trie = ng.trie
    assert trie.find([1, 2]) is None and trie.find([2, 1]) is not None and trie.size == 3
    check_trie(ng)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 6), max_size=8)), max_size=40),
       st.integers(21, 60), st.sampled_from(["BFS", "PROB"]))
def test_capacity_is_kept_and_only_leaves_are_evicted(steps, capacity, match_type):
    ng = make(match_type, capacity=capacity)
    hist = {f"r{i}": [i] for i in range(4)}
    for rid, h in hist.items():
        ng.add_request(rid, h)
    for r, tokens in steps:
        rid = f"r{r}"
        ng.on_tokens(rid, tokens)
        hist[rid] += tokens
        check_trie(ng)
        h, trie = hist[rid], ng.trie
        for n in range(1, min(len(h), trie.branch_length) * bool(tokens) + 1):  # just written: kept
            assert trie.find(h[-n:]) is not None
        d = ng.propose(list(hist), [h[-1] for h in hist.values()])
        for b, h in enumerate(hist.values()):
            check_tree(d, b, h[-1], ng.num_draft_tokens)


def test_evicted_anchors_are_rebuilt_and_drafting_recovers():
    rnd = random.Random(0)
    ng = make(capacity=60)
    phrase = [100, 101, 102, 103, 104, 105]
    ng.add_request("a", phrase)
    ng.add_request("noise", [])
    ng.on_tokens("noise", [rnd.randrange(50) for _ in range(200)])  # evicts all of "a"'s n-grams
    assert ng.trie.find(phrase[-2:]) is None and ng.trie.evicted > 0
    assert tree(ng, "a", 105) == ([105], [-1])  # dead anchors match nothing
    ng.on_tokens("a", [100, 101])  # rebuilds its anchors; the phrase is learned again
    ng.on_tokens("a", [102, 103, 104, 105, 100])
    assert tree(ng, "a", 100)[0] == [100, 101, 102, 103, 104, 105]
    check_trie(ng)
