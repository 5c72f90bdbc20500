"""The batch tree's rules (spec/eagle/batch_tree.py): what it may be against the main tree, and
where `auto` takes it from. Its drafting is checked end to end in test_spec_pipeline.py."""
from __future__ import annotations

import pytest

from specserve.spec.eagle.batch_tree import TreeShape, check_against, parse_tree, resolve

MAIN = TreeShape(5, 6, 32)


@pytest.mark.parametrize("value, want", [("3,2,6", TreeShape(3, 2, 6)), ("off", None)])
def test_parse(value: str, want: TreeShape | None) -> None:
    assert parse_tree(value) == want


@pytest.mark.parametrize("batch", ["3,1,4", "3,2,6", "2,1,3", "5,6,31"])
def test_smaller_trees_of_the_same_head_pass(batch: str) -> None:
    check_against(MAIN, parse_tree(batch))


@pytest.mark.parametrize("batch, why", [
    ("1,1,2", "needs at least 2 steps"),
    ("6,1,7", "at most the main tree's 5 steps"),
    ("3,8,6", "at most the main tree's topk 6"),
    ("5,6,32", "fewer tokens than the main tree's 32"),
    ("3,1,5", "has only 3 candidates, so at most 4 draft tokens"),
])
def test_what_a_batch_tree_may_not_be(batch: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        check_against(MAIN, parse_tree(batch))


def test_auto_takes_the_heads_batch_tree_only_with_its_main_tree() -> None:
    assert resolve("auto", [3, 2, 6], tree_from_head=True) == "3,2,6"
    assert resolve("auto", [3, 2, 6], tree_from_head=False) == "off"  # the user's own tree flags
    assert resolve("auto", None, tree_from_head=True) == "off"
    assert resolve("2,1,3", None, tree_from_head=False) == "2,1,3"
