"""Drafts: depths, positions, tree masks and child lists, on the internals note's example
and on random trees."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.spec.drafts import Drafts


def test_worked_example_from_the_internals_note():
    # root, 10, 11, 20 (child of 10), 30 (child of 11), 40 (child of 20)
    d = Drafts.from_lists([[5, 10, 11, 20, 30, 40]], [[-1, 0, 0, 1, 2, 3]])
    assert d.depths().tolist() == [[0, 1, 1, 2, 2, 3]]
    assert d.positions(torch.tensor([100])).tolist() == [[100, 101, 101, 102, 102, 103]]
    rows = ["".join(str(int(v)) for v in row) for row in d.tree_mask()[0]]
    assert rows == ["100000", "110000", "101000", "110100", "101010", "110101"]
    first, sibling = d.child_lists()
    assert first.tolist() == [[1, 3, 4, 5, -1, -1]] and sibling.tolist() == [[-1, 2, -1, -1, -1, -1]]


def test_ragged_chains_are_padded_with_invalid_nodes():
    d = Drafts.chains([1, 2], [[3, 4, 5], []])
    assert d.tokens.tolist() == [[1, 3, 4, 5], [2, 0, 0, 0]]
    assert d.valid.tolist() == [[True] * 4, [True, False, False, False]]
    first, _ = d.child_lists()
    assert first[1].tolist() == [-1, -1, -1, -1]  # padding is never a child


@st.composite
def trees(draw):
    n = draw(st.integers(1, 12))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    return parents


@settings(max_examples=80, deadline=None)
@given(trees())
def test_mask_is_ancestor_closure_and_lists_cover_every_child(parents):
    d = Drafts.from_lists([list(range(len(parents)))], [parents])
    mask, depth = d.tree_mask()[0], d.depths()[0]
    first, sibling = d.child_lists()
    for i, p in enumerate(parents):
        ancestors, j = {i}, i
        while parents[j] != -1:
            j = parents[j]
            ancestors.add(j)
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == ancestors
        assert int(depth[i]) == len(ancestors) - 1
        children, c = [], int(first[0, i])
        while c != -1:
            children.append(c)
            c = int(sibling[0, c])
        assert children == [k for k, q in enumerate(parents) if q == i]


@settings(max_examples=40, deadline=None)
@given(st.lists(trees(), min_size=1, max_size=3))
def test_the_host_mask_is_the_matmul_mask(rows):
    """A small tree on the CPU takes drafts._host_mask, as Python ints for few trees and
    as numpy bitsets for many; the matmul closure gives the same."""
    from specserve.spec import drafts

    n = max(map(len, rows))
    parents = torch.tensor([row + [0] * (n - len(row)) for row in rows])  # padding hangs off the root
    ints = drafts.ancestor_mask(parents)
    saved = drafts.HOST_NODES, drafts.HOST_LOOP
    try:
        drafts.HOST_LOOP = 0
        bitsets = drafts.ancestor_mask(parents)
        drafts.HOST_NODES = 0
        assert torch.equal(ints, drafts.ancestor_mask(parents))
        assert torch.equal(bitsets, ints)
    finally:
        drafts.HOST_NODES, drafts.HOST_LOOP = saved
