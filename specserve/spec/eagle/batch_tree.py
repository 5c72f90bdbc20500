"""The batch tree: the smaller draft tree EAGLE's step graphs use for batches of 2 and more.

At batch 1 a verify of N tree tokens costs about one decode step (the GPU waits on weight
reads either way), so the tree that gets the most tokens accepted wins: the shipped SmolLM2
head drafts 5,6,32 (steps, topk, draft tokens). At batch 64 that verify is 2048 tokens,
arithmetic the GPU pays for, and the drafting pass runs six branches a request; a small
tree verifies a fraction of the tokens for somewhat fewer accepted, and wins from two
requests up (the head names its batch tree, 3,2,6, in its config; docs/benchmarks.md has
the figures). Two requests of 32 nodes are 64 tokens, past the few-token kernels' 32
(kernels/skinny.py).

So a step graph of at least `batch_tree_from` requests drafts and verifies the batch tree
(step_graphs.py, keyed by its captured size), and smaller ones the main tree. A pipelined
run keeps one tree: a batch that shrinks across the threshold drains, and the next run
drafts the other tree (worker.py `_pipelines`). Steps outside the step graphs (logits
processors, logprobs, filtered sampling) always use the main tree. Both trees come from the same
head and the same root states (the batch tree's topk <= the main tree's: its root
children are the first of the main tree's, which are sorted best first), and the draft
extend after a verify commits at most steps + 1 tokens of either.
"""
from __future__ import annotations

from dataclasses import dataclass

OFF, AUTO = "off", "auto"


@dataclass(frozen=True)
class TreeShape:
    steps: int
    topk: int
    nodes: int  # draft tokens verified per request, the root included

    def __str__(self) -> str:
        return f"{self.steps},{self.topk},{self.nodes}"

    @property
    def candidates(self) -> int:
        """Nodes a drafting pass scores (tree_draft.py `max_candidates`)."""
        return self.topk + (self.steps - 1) * self.topk * self.topk


def parse_tree(value: str) -> TreeShape | None:
    """'steps,topk,draft tokens' -> TreeShape; 'off' -> None. ValueError otherwise."""
    if value == OFF:
        return None
    try:
        steps, topk, nodes = (int(v) for v in value.split(","))
    except ValueError:
        raise ValueError(f"--speculative-batch-tree must be off, auto or STEPS,TOPK,DRAFT_TOKENS "
                         f"(e.g. 3,2,6), got {value!r}") from None
    return TreeShape(steps, topk, nodes)


def check_against(main: TreeShape, batch: TreeShape) -> None:
    """The batch tree must be a smaller tree the main tree's state can draft: ValueError
    naming the flag otherwise."""
    flag = f"--speculative-batch-tree {batch}"
    for failed, why in (
        (batch.steps < 2, "needs at least 2 steps (its drafting pass is a step graph's)"),
        (batch.steps > main.steps, f"may take at most the main tree's {main.steps} steps (the draft "
                                   "extend after a verify commits at most steps + 1 tokens)"),
        (batch.topk > main.topk, f"may branch at most the main tree's topk {main.topk} (it drafts "
                                 "from the same root children)"),
        (batch.nodes >= main.nodes, f"must verify fewer tokens than the main tree's {main.nodes}"),
        (batch.nodes < 2, "must verify at least one draft token"),
        (batch.nodes - 1 > batch.candidates,
         f"has only {batch.candidates} candidates, so at most {batch.candidates + 1} draft tokens"),
    ):
        if failed:
            raise ValueError(f"{flag} {why} (main tree {main})")


def resolve(value: str, head_tree: list[int] | None, tree_from_head: bool) -> str:
    """The batch tree an engine drafts: an explicit one as given; auto -> the head's own
    (`specserve_batch_tree` in its config) when the main tree is the head's default too,
    else off (a user's own tree flags are not second-guessed)."""
    if value != AUTO:
        return value
    if head_tree is None or not tree_from_head:
        return OFF
    return str(TreeShape(*(int(v) for v in head_tree)))
