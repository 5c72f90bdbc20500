"""STANDALONE steps pipelined (spec/pipeline.py, spec/standalone/ahead.py): the draft LLM
catches up through the bonus token and drafts the next trees before a verify is read back.

On the CPU the pipeline is forced on over the graph-shaped catch-up and tree pass, run
eagerly (the same static buffers, padding and table indices as their CUDA graphs).
Checked here, chain (3, 1, 4) and tree (3, 2, 6):
  * greedy output is plain decoding's, token for token, at batch 8 with requests ending at
    different steps (their places in the step in flight are dropped, undrained);
  * a self-draft (the target drafting for itself) stays at full depth: a wrong root
    slot, position or catch-up collapses its acceptance without breaking equality;
  * stop tokens, plain steps chosen by the governor, an arrival and an abort while a step
    is in flight: outputs exact, no slot leaked, the draft caught up after each.
"""
from __future__ import annotations

import pytest

from specserve.spec.pipeline import InFlightSpec
from tests.unit.eagle_utils import (
    SomePlain,
    arrival_and_abort_while_in_flight,
    count_calls,
    engine,
    prompts,
    run,
    spec_flags,
    tiny_target,
)
from tests.unit.model_utils import save_tiny_hf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    """A tiny random target, a random draft of its vocabulary, prompts, and plain greedy outputs of 30 tokens."""
    root = tmp_path_factory.mktemp("standalone_pipeline")
    target = tiny_target(root / "target")
    draft = save_tiny_hf("llama", root / "draft", vocab_size=49152, max_position_embeddings=1024, num_hidden_layers=2)
    ps = prompts(8, seed=7)
    ref = [o["output_ids"] for o in run(engine(target, smollm2_dir), ps, _greedy(30))]
    return target, draft, ps, ref


def _greedy(n: int, **more) -> dict:
    return {"temperature": 0, "max_new_tokens": n, **more}


def _pipelined(target, draft, smollm2_dir, tree: str, monkeypatch, counts: dict, max_bs: int = 8):
    """A STANDALONE engine whose greedy steps are left in flight over the graph-shaped
    drafting paths, counting launches, lands, drains and drops."""
    from specserve.spec.tree.extend_graphs import DraftExtendGraphs
    from specserve.spec.tree.graphs import TreeDraftGraphs

    eng = engine(target, smollm2_dir, **spec_flags("STANDALONE", draft, tree))
    worker = eng.scheduler.spec
    p = worker.proposer
    p.extend_graphs = DraftExtendGraphs(p.model, p.backend, p.pool, p.table, max_bs, p.catch_up_len, 0, p.topk,
                                        None, p.roots, capture=False, table_slots=True)
    p.tree.graphs = TreeDraftGraphs(p.tree, p.roots, max_bs, p.max_nodes, p.runner.device, capture=False)
    worker.pipeline = True
    for obj, name in ((worker, "_launch"), (worker, "_land"), (worker, "drain"), (InFlightSpec, "drop"),
                      (p, "draft_ahead")):
        count_calls(obj, name, counts, monkeypatch)
    return eng


@pytest.mark.parametrize("tree", ["chain", "tree"])
def test_pipelined_standalone_is_token_identical(tiny, smollm2_dir, tree, monkeypatch):
    """A random draft: the batch shrinks as requests end, each next step going on from the
    rows of the step in flight."""
    target, draft, ps, ref = tiny
    counts: dict = {}
    eng = _pipelined(target, draft, smollm2_dir, tree, monkeypatch, counts)
    params = [_greedy(30 - 4 * (i % 3)) for i in range(8)]
    outs = run(eng, ps, params)
    assert [o["output_ids"] for o in outs] == [r[:p["max_new_tokens"]] for r, p in zip(ref, params)]
    assert counts["_launch"] >= 10 and counts["_land"] >= counts["_launch"] - 2, counts
    assert counts["draft_ahead"] == counts["_launch"] and counts["drop"] >= 4, counts
    assert counts.get("drain", 0) == 0, counts


@pytest.mark.parametrize("tree", ["chain", "tree"])
def test_a_self_draft_stays_at_full_depth_when_pipelined(tiny, smollm2_dir, tree, monkeypatch):
    """The target drafting for itself: every pipelined step's catch-up (root, accepted
    nodes, the bonus into the root slot) and tree pass must be right for the chain to go
    on accepting 3 drafts a step, and for each request's acceptance to be the one it has
    unpipelined (a random tiny target's flat tree scores keep the tree's best nodes
    shallow)."""
    target, _, ps, ref = tiny
    counts: dict = {}
    eng = _pipelined(target, target, smollm2_dir, tree, monkeypatch, counts, max_bs=4)
    params = [_greedy(1 + 4 * n) for n in (7, 5, 6)]  # 1 from prefill + n verifies of 4
    outs = run(eng, ps[:3], params)
    assert [o["output_ids"] for o in outs] == [r[:p["max_new_tokens"]] for r, p in zip(ref, params)]
    unpipelined = run(engine(target, smollm2_dir, **spec_flags("STANDALONE", target, tree)), ps[:3], params)
    got, want = ([o["meta_info"]["spec_accept_length"] for o in r] for r in (outs, unpipelined))
    assert got == pytest.approx(want, abs=0.25), (got, want)
    assert tree == "tree" or min(got) > 3.5, got
    assert counts["_launch"] >= 5 and counts.get("drain", 0) == 0, counts


def test_stop_tokens_and_plain_steps_while_pipelined(tiny, smollm2_dir, monkeypatch):
    """Requests stopped by a token of their own output at different steps, and the
    governor turning speculation down every third step (a drain, then plain steps the
    draft catches up over): outputs exact, a self-draft still accepted at depth."""
    target, _, ps, ref = tiny
    counts: dict = {}
    eng = _pipelined(target, target, smollm2_dir, "chain", monkeypatch, counts)
    gov = eng.scheduler.spec.governor = SomePlain(plain_run=1)
    params, want = [], []
    for i, r in enumerate(ref[:4]):
        stop = r[8 + 4 * i]
        params.append(_greedy(30, stop_token_ids=[stop]))
        want.append(r[:r.index(stop) + 1])
    outs = run(eng, ps[:4], params)
    assert [o["output_ids"] for o in outs] == want
    assert False in gov.modes and counts["drain"] >= 1 and counts["_launch"] >= 4, counts
    assert max(o["meta_info"]["spec_accept_length"] for o in outs) > 3.0


def test_an_arrival_and_an_abort_while_a_step_is_in_flight(tiny, smollm2_dir, monkeypatch):
    """A request arriving is prefilled while a step is in flight; aborting a request the
    step in flight carries reads that step back first. Outputs stay exact."""
    target, draft, ps, ref = tiny
    arrival_and_abort_while_in_flight(_pipelined(target, draft, smollm2_dir, "tree", monkeypatch, {}), ps, ref)
