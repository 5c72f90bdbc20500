"""NGRAM's match gate (spec/ngram/gate.py): drafts whose match length has not paid at the
governor's price are left out, now and then drafted to keep up, and leaving them out
changes no output."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from specserve.spec.ngram.adapter import NgramAdapter
from specserve.spec.ngram.gate import CAP, EXPLORE, MatchGate
from specserve.spec.ngram.proposer import NgramProposer
from tests.unit.model_utils import save_tiny_hf, tiny_engine


def test_without_a_price_every_match_drafts():
    gate = MatchGate()
    gate.record(1, 1)
    assert gate.allows(1) and gate.allows(5) and not gate.allows(0)


def test_a_match_length_that_does_not_pay_is_left_out_and_explored():
    gate = MatchGate()
    for _ in range(4):
        gate.record(1, 1)  # one-token matches: nothing accepted
        gate.record(6, 9)
    gate.price = 3.0  # a speculative step costs three plain ones
    assert gate.allows(6) and gate.allows(2)  # pays; not measured yet
    drafted = [gate.allows(1) for _ in range(3 * EXPLORE)]
    assert [i for i, d in enumerate(drafted) if d] == [EXPLORE - 1, 2 * EXPLORE - 1, 3 * EXPLORE - 1]
    for _ in range(10):
        gate.record(1, 5)  # the text turned repetitive: the bucket follows
    assert gate.allows(1) and gate.mean(1) > 3.0


def test_long_matches_share_a_bucket():
    gate = MatchGate()
    gate.record(CAP + 4, 7)
    assert gate.mean(CAP) == gate.mean(CAP + 1) == 7.0


def test_the_hint_says_whether_the_batchs_matches_would_pay():
    ngram = NgramProposer(min_window=1, max_window=4, min_bfs_breadth=1, max_bfs_breadth=2, match_type="BFS",
                          branch_length=6, capacity=1000, num_draft_tokens=4)
    adapter = NgramAdapter(ngram)
    req = SimpleNamespace(rid="a", all_ids=[1, 2, 3, 4, 5, 1, 2, 3], last_id=3)  # what a Req offers the adapter
    adapter.add_request(req)
    assert adapter.drafts_pay([req]) is None  # no price yet: the governor decides alone
    adapter.on_price(3.0)
    assert adapter.drafts_pay([req]) and ngram.match_length("a") == 3  # 1 2 3 -> 4, never drafted from
    for _ in range(5):
        adapter.gate.record(3, 1)
    assert not adapter.drafts_pay([req])  # such matches committed one token: below the price
    req.all_ids, req.last_id = req.all_ids + [4], 4  # a plain step's token: the trie catches up
    assert adapter.drafts_pay([req]) and ngram.match_length("a") == 4
    for _ in range(5):
        adapter.gate.record(4, 9)
    other = SimpleNamespace(rid="b", all_ids=[7, 8, 9], last_id=9)  # no match: a decode in a speculative step
    adapter.add_request(other)
    assert adapter.drafts_pay([req, other])  # 9 + 1 tokens expected against 2 x 3 for two plain steps
    adapter.on_price(6.0)
    assert not adapter.drafts_pay([req, other]) and adapter.drafts_pay([req])  # 10 < 2 x 6; 9 >= 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    target = save_tiny_hf("llama", tmp_path_factory.mktemp("gate") / "target", vocab_size=49152,
                          max_position_embeddings=1024, num_hidden_layers=2)
    rng = random.Random(3)
    return target, [[rng.randrange(3, 200) for _ in range(5)] * 4 for _ in range(3)]


def test_gated_drafts_change_no_output(tiny, smollm2_dir):
    """A price no draft meets: at batch 1 the proposer leaves drafts out (a decode for the
    request) but for its explorations; above it every match drafts. The outputs equal plain
    decoding's and every slot comes back."""
    target, prompts = tiny
    greedy = {"temperature": 0, "max_new_tokens": 40}
    want = [o["output_ids"] for o in tiny_engine(target, smollm2_dir).generate(input_ids=prompts,
                                                                               sampling_params=greedy)]
    engine = tiny_engine(target, smollm2_dir, speculative_algorithm="NGRAM", speculative_adaptive="off")
    worker = engine.scheduler.spec
    worker.governor.cost_ratio = lambda bs: 100.0
    sizes = []
    propose = worker.proposer.ngram.propose

    def counted(rids, roots, budgets=None):
        sizes.extend(budgets)
        return propose(rids, roots, budgets)

    worker.proposer.ngram.propose = counted
    asked = []
    drafts_pay = worker.proposer.drafts_pay
    worker.proposer.drafts_pay = lambda reqs: asked.append(len(reqs)) or drafts_pay(reqs)
    for batch in (prompts[:1], prompts):
        outs = engine.generate(input_ids=batch, sampling_params=greedy)
        assert [o["output_ids"] for o in outs] == want[:len(batch)]
    assert 1 in sizes and max(sizes) > 1  # left out, and drafted (first sight of a length, explorations)
    assert asked and set(asked) == {1}  # the proposer's word is asked for at batch 1 only
    engine.scheduler.kv.flush_cache()
    engine.scheduler.kv.assert_no_leak()
