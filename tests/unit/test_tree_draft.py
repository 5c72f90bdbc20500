"""TreeDrafter: every branch's draft forward sees exactly its own ancestors.

A fake draft step makes each node's children encode the node's own scratch slot in their
token ids (child j of the node in slot s is token 7*s + j), so from any forward row we can
walk the true ancestry back to the root and compare it with the slots the row reads: its
request's table row below tail_start, then its tail. Checked for a draft LLM (shift 0) and EAGLE (shift 1), with ragged
request lengths, and with varying scores so expansion picks children across parents.
"""
from __future__ import annotations

import pytest
import torch

from specserve.core.h2d import h2d_many
from specserve.core.request import Req
from specserve.core.sampling_params import SamplingParams
from specserve.engine.kv_manager import KVManager
from specserve.spec.tree.draft import TreeDrafter, TreeInputs, row_topk, top_children

V, ROOT_KID = 4096, 4000  # the root's children are tokens 4000 + j


def _req(kv: KVManager, rid: str, n: int) -> Req:
    req = Req(rid, list(range(10, 10 + n)), SamplingParams(temperature=0), 0, None, None)
    req.table_row = kv.table.alloc()
    kv.table.write(req.row, 0, kv.alloc_slots(n))
    req.kv_len = n - 1  # decode state: the last token is the root
    return req


@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("topk,steps", [(2, 4), (3, 3), (1, 4)])
def test_each_branch_attends_to_exactly_its_ancestors(shift, topk, steps):
    kv = KVManager(512, 64, 128, torch.device("cpu"), enable_prefix_cache=False)
    reqs = [_req(kv, "a", 9), _req(kv, "b", 15)]
    if shift == 0:  # a draft LLM has the root's KV in its verify slot at kv_len
        for r in reqs:
            kv.table.write(r.row, r.kv_len, kv.alloc_slots(1))
    token_of_slot: dict[int, int] = {}
    checked, mixed, branch_of_slot = [], {"yes": False}, {}

    by_row = {r.row: r for r in reqs}

    def step(frame, states):
        logits = torch.full((len(frame.ids), V), -30.0)
        depth = frame.tail.shape[1]
        for i, (row, pos, start, tok, slot, tail) in enumerate(zip(
                frame.rows.tolist(), frame.positions.tolist(), frame.tail_start.tolist(), frame.ids.tolist(),
                frame.out_slots.tolist(), frame.tail.tolist())):
            req = by_row[row]
            token_of_slot[slot] = tok
            assert start == frame.host_tail_start[i] == req.kv_len + 1 - shift  # below the depth-1 nodes
            assert pos == req.kv_len + depth - shift == start + depth - 1
            assert tail == _ancestry(slot, token_of_slot) and tail[-1] == slot
            assert states is not None and torch.equal(states[i], torch.full((4,), float(_parent_slot(tok))))
            for j in range(topk):  # children of this node, more or less peaked per node, so
                logits[i, 7 * slot + j] = -j * (0.05 + (slot % 4) * 1.5)  # winners mix parents
            checked.append(depth)
            branch_of_slot[slot] = i
            parent = _parent_slot(tok)
            if parent != -1 and branch_of_slot[parent] != i:
                mixed["yes"] = True  # this node's parent ran as another branch index
        # the next states: each node's own slot, so a child's incoming state names its parent
        return logits, frame.out_slots.float()[:, None].repeat(1, 4)

    drafter = TreeDrafter(kv, step, topk, steps, shift=shift)
    first_ids = torch.tensor([[ROOT_KID + j for j in range(topk)]] * len(reqs))
    first_logp = torch.tensor([[-0.1 * (j + 1) for j in range(topk)]] * len(reqs))
    free_rows, free_slots = kv.table.available, kv.allocator.available
    drafts = drafter.draft(reqs, 1 + topk * steps, (first_logp, first_ids), states=torch.full((len(reqs), 4), -1.0))
    assert sorted(set(checked)) == list(range(1, steps))  # every depth but the last ran
    assert topk == 1 or mixed["yes"], "the test must make some branch's parent differ from its row"
    assert (kv.table.available, kv.allocator.available) == (free_rows, free_slots)  # scratch returned, no rows taken
    assert drafts.counts == [min(1 + topk * steps, 1 + drafter.max_candidates)] * len(reqs)
    for req, tokens, parents in zip(reqs, drafts.tokens.tolist(), drafts.parents.tolist()):
        assert (parents[0], tokens[0]) == (-1, req.all_ids[-1])
        for i in range(1, len(tokens)):
            assert 0 <= parents[i] < i  # tree edges agree with the encoded ancestry
            p = parents[i]
            assert (tokens[i] >= ROOT_KID) == (p == 0)
            if p > 0:
                assert tokens[i] // 7 in [s for s, t in token_of_slot.items() if t == tokens[p]]


def _parent_slot(token: int) -> int:
    return -1 if token >= ROOT_KID else token // 7


def _ancestry(slot: int, token_of_slot: dict[int, int]) -> list[int]:
    """Slots from the depth-1 ancestor down to `slot` itself, following the encoded parents."""
    chain = [slot]
    while (parent := _parent_slot(token_of_slot[chain[-1]])) != -1:
        chain.append(parent)
    return chain[::-1]


@pytest.mark.parametrize("vocab", [16384, 32001, 3000, 100])
@pytest.mark.parametrize("k", [1, 4, 10])
def test_two_stage_topk_is_topk(vocab, k):
    """row_topk (chunked, -inf padding for ragged rows) keeps torch.topk's values, order
    and, without ties, its indices; top_children's log-probabilities are log_softmax's."""
    x = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab + k))
    got, idx = row_topk(x, k)
    want, want_idx = x.topk(k, dim=-1)
    assert torch.equal(got, want) and torch.equal(idx, want_idx)
    logp, ids = top_children(x, k, None)
    torch.testing.assert_close(logp, x.log_softmax(-1).topk(k, dim=-1).values)
    assert torch.equal(ids, want_idx)
    tied = torch.zeros(2, vocab)
    tied[:, 7::vocab // 40] = 1.0  # more equal maxima than k: any k of them, each index once
    vals, idx = row_topk(tied, k)
    assert torch.equal(vals, torch.ones(2, k)) and torch.equal(tied.gather(1, idx), vals)
    assert all(len(set(row)) == k for row in idx.tolist())


@pytest.mark.parametrize("topk,nodes", [(1, 2), (3, 2), (3, 3), (3, 4)])
def test_one_depth_trees_skip_the_selection_and_equal_it(topk, nodes):
    """num_steps 1 on the CPU builds the trees from the root's children directly
    (`_one_depth`): the same trees as the generic pass's selection."""
    kv = KVManager(512, 64, 128, torch.device("cpu"), enable_prefix_cache=False)
    reqs = [_req(kv, "a", 9), _req(kv, "b", 15)]
    drafter = TreeDrafter(kv, lambda frame, states: (None, None), topk, 1, shift=1)
    first_ids = torch.tensor([[ROOT_KID + j for j in range(topk)], [ROOT_KID + 2 * j for j in range(topk)]])
    first_logp = torch.tensor([[-0.1 * (j + 1) for j in range(topk)]] * len(reqs))
    got = drafter.draft(reqs, nodes, (first_logp, first_ids), states=None)
    roots, rows, start = h2d_many([[r.last_id for r in reqs], [r.row for r in reqs], [r.kv_len for r in reqs]],
                                  torch.device("cpu"))
    x = TreeInputs(first_logp, first_ids, None, roots, rows, start, torch.empty(0, len(reqs) * topk, dtype=torch.int64))
    tokens, parents, mask = drafter.expand(x, drafter.step, nodes)
    assert torch.equal(got.tokens, tokens) and torch.equal(got.parents, parents)
    assert torch.equal(got.tree_mask(), mask)
