"""Pipelined speculative steps (spec/pipeline.py): step k+1 launched before step k is read back.

On the CPU the pipeline is forced on over the graph-shaped drafting paths, run eagerly;
the device state it launches from (kv_len after the commit, the table, the trees drafted
ahead) is the same. Checked here:
  * greedy output is plain decoding's, token for token, at batch 8 and 3, with requests
    ending at different steps (their places in the step in flight are dropped, and the
    next step goes on from the others' rows of it, undrained);
  * a perfect draft stays at full depth (a stale kv_len, position or prefix collapses it);
  * a stop token inside a step, an abort, a request arriving, and plain steps chosen by
    the governor, each while a step is in flight: outputs exact, no slot leaked;
  * which steps may be left in flight (greedy, no logprobs, room before the context length).
"""
from __future__ import annotations

import pytest
import torch

from specserve.core.messages import GenerateReq
from specserve.models.draft_layouts import save_eagle2, save_eagle3
from specserve.offline import make_sampling_params
from specserve.spec import pipeline
from specserve.spec.governor import SpecGovernor
from specserve.spec.pipeline import InFlightSpec
from tests.unit.eagle_utils import (
    SomePlain,
    arrival_and_abort_while_in_flight,
    clean,
    collect,
    count_calls,
    engine,
    perfect_engine,
    prompts,
    run,
    spec_flags,
    step_until,
    tiny_target,
    use_static_paths,
    use_step_graphs,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    """A tiny random target, random EAGLE-2 and EAGLE-3 heads, and plain greedy outputs of 30 tokens."""
    root = tmp_path_factory.mktemp("pipeline")
    target = tiny_target(root / "target")
    heads = {"EAGLE": save_eagle2(root / "eagle2", target, bias=True),
             "EAGLE3": save_eagle3(root / "eagle3", target, draft_vocab=4096)}
    ps = prompts(8, seed=5)
    ref = [o["output_ids"] for o in run(engine(target, smollm2_dir), ps, {"temperature": 0, "max_new_tokens": 30})]
    return target, heads, ps, ref


def _pipeline(eng, graphed: bool | str, max_bs: int) -> None:
    """Leave greedy steps in flight, launched through the whole-step graph's body
    (step_graphs.py: batches up to max_bs; "padded": graphs of 1, 2, 4, 8 requests, a
    batch padded up to the next; "batch tree": with the engine's batch tree) or step by
    step (`SpecWorker._launch`)."""
    if graphed:
        use_step_graphs(eng, max_bs, exact=1 if graphed == "padded" else 8)
    else:
        use_static_paths(eng, max_bs)
        eng.scheduler.spec.pipeline = True


def _pipelined(target, smollm2_dir, head: str, draft, monkeypatch, counts: dict, graphed: bool | str = True,
               **flags):
    """An EAGLE engine whose greedy steps are left in flight, counting launches, lands and drops."""
    eng = engine(target, smollm2_dir, **spec_flags(head, draft, "tree"), **flags)
    _pipeline(eng, graphed, max_bs=8)
    worker = eng.scheduler.spec
    count_calls(worker, "_launch", counts, monkeypatch)
    count_calls(worker, "_land", counts, monkeypatch)
    count_calls(InFlightSpec, "drop", counts, monkeypatch)
    return eng


def _greedy(n: int) -> dict:
    return {"temperature": 0, "max_new_tokens": n}


# the batch tree (batch_tree.py) from 4 requests up: batches of 8 and 6 draft 2,1,3, the last 3 the main 3,2,6
BATCH_TREE = {"speculative_batch_tree": "2,1,3", "speculative_batch_tree_from": 4}


@pytest.mark.parametrize("head,graphed", [("EAGLE", True), ("EAGLE3", True), ("EAGLE3", "padded"),
                                          ("EAGLE3", False), ("EAGLE3", "batch tree")])
def test_pipelined_steps_are_token_identical(tiny, smollm2_dir, head, graphed, monkeypatch):
    target, heads, ps, ref = tiny
    counts: dict = {}
    flags = BATCH_TREE if graphed == "batch tree" else {}
    eng = _pipelined(target, smollm2_dir, head, heads[head], monkeypatch, counts, graphed, **flags)
    if graphed:
        count_calls(eng.scheduler.spec, "_launch_graphed", counts, monkeypatch)
    sizes = _spy_padding(eng, monkeypatch) if graphed == "padded" else None
    trees = _spy_trees(eng, monkeypatch) if flags else None
    count_calls(eng.scheduler.spec, "drain", counts, monkeypatch)
    params = [_greedy(30 - 4 * (i % 3)) for i in range(8)]
    outs = run(eng, ps, params) + run(eng, ps[:3], params[:3])
    assert [o["output_ids"] for o in outs] == [r[:p["max_new_tokens"]] for r, p in zip(ref + ref[:3], params + params[:3])]
    # most steps were left in flight and read back one step later; the batch shrank 4
    # times, and each next step went on from the rows of the step in flight, undrained
    # (but once with a batch tree: from 6 requests to 3 the tree changes, a new run)
    assert counts["_launch"] >= 6 and counts["_land"] >= counts["_launch"] - 2, counts
    assert counts["drop"] >= 4 and counts.get("drain", 0) == (1 if flags else 0), counts
    if trees is not None:  # (batch, N): the batch tree's 3 nodes at 8 and 6 requests, the main's 6 below 4
        assert {(8, 3), (6, 3), (3, 6)} <= trees and all((n == 3) == (b >= 4) for b, n in trees), trees
        assert {o["meta_info"]["spec_accept_rate"] <= 1 for o in outs} == {True}
    if graphed:  # batch 8 and 3 both fit the step graphs
        assert counts["_launch_graphed"] == counts["_launch"], counts
    if sizes is not None:  # 6 and 3 requests ran as padded batches of 8 and 4
        assert {(6, 8), (3, 4)} <= sizes, sizes


def _spy_trees(eng, monkeypatch) -> set:
    """The (batch, tree nodes) pairs the step graphs launch from now on."""
    graphs, seen = eng.scheduler.spec.step_graphs, set()
    real = graphs.launch

    def launch(reqs, slots, first):
        seen.add((len(reqs), slots.numel() // len(reqs)))
        return real(reqs, slots, first)
    monkeypatch.setattr(graphs, "launch", launch)
    return seen


def _spy_padding(eng, monkeypatch) -> set:
    """The (batch, graph size) pairs the step graphs replay from now on."""
    graphs, seen = eng.scheduler.spec.step_graphs, set()
    real = graphs.size_for
    assert graphs.sizes == [1, 2, 4, 8]
    monkeypatch.setattr(graphs, "size_for", lambda b: seen.add((b, real(b))) or real(b))
    return seen


@pytest.mark.parametrize("graphed", [True, "padded", "batch tree"])
def test_sampled_steps_in_step_graphs_reproduce_seeded_plain_sampling(tiny, smollm2_dir, graphed, monkeypatch):
    """Sampled steps walk Gumbel targets keyed by each node's output index, which the step
    graph derives from the kv_len it carries: seeded outputs are plain sampling's, token
    for token, in a batch that mixes greedy and sampled requests (padded: three requests
    replay the graph of four; batch tree: from 2 requests up the batch tree drafts). The
    last request limits top-k, top-p and min-p: its floors are found in the graph."""
    target, heads, ps, _ = tiny
    params = [{"temperature": t, "seed": 11 + i, "max_new_tokens": 30} for i, t in enumerate((1.0, 0.0, 0.7))]
    params[2].update(top_k=20, top_p=0.9, min_p=0.02)
    want = [o["output_ids"] for o in run(engine(target, smollm2_dir), ps[:3], params)]
    counts: dict = {}
    flags = {**BATCH_TREE, "speculative_batch_tree_from": 2} if graphed == "batch tree" else {}
    eng = _pipelined(target, smollm2_dir, "EAGLE3", heads["EAGLE3"], monkeypatch, counts, graphed, **flags)
    count_calls(eng.scheduler.spec, "_launch_graphed", counts, monkeypatch)
    outs = run(eng, ps[:3], params) + run(eng, ps[:1], params[:1])
    assert [o["output_ids"] for o in outs] == want + want[:1]
    assert counts["_launch_graphed"] >= 6, counts


class _DrawsFused:
    """specserve.kernels as seen by the sampler and the accept walk, with the fused side of
    the switch on for them alone (on a CPU: the Triton interpreter)."""

    def __getattr__(self, name: str):
        from specserve import kernels

        return getattr(kernels, name)

    @staticmethod
    def use_fused(t: torch.Tensor) -> bool:
        return True


def test_sampled_steps_draw_in_the_argmax_kernel_as_plain_sampling_does(tiny, smollm2_dir, monkeypatch):
    """With the fused draw (kernels/argmax.py) in plain sampling and in the step graphs'
    sampled walk, seeded outputs are still plain sampling's token for token: both form
    logits / T + noise in the kernel the same way, greedy and sampled requests mixed, and
    the filtered request's floors from the same kernel (kernels/filters.py).
    (The random head's drafts rarely hit, so the nodes' depth keys are checked by
    test_sampled_argmax.py's walk test.)"""
    from specserve.runner import sampler
    from specserve.spec import accept

    monkeypatch.setattr(sampler, "kernels", _DrawsFused())
    monkeypatch.setattr(accept, "kernels", _DrawsFused())
    target, heads, ps, _ = tiny
    params = [{"temperature": t, "seed": 21 + i, "max_new_tokens": 10} for i, t in enumerate((1.0, 0.0, 0.7))]
    params[2].update(min_p=0.05)  # one pass a row: the interpreter is slow (bisection: test_filter_floors.py)
    want = [o["output_ids"] for o in run(engine(target, smollm2_dir), ps[:3], params)]
    counts: dict = {}
    eng = _pipelined(target, smollm2_dir, "EAGLE3", heads["EAGLE3"], monkeypatch, counts)
    count_calls(eng.scheduler.spec, "_launch_graphed", counts, monkeypatch)
    assert [o["output_ids"] for o in run(eng, ps[:3], params)] == want
    assert counts["_launch_graphed"] >= 3, counts


@pytest.mark.parametrize("graphed", [True, "padded", False])
def test_a_perfect_draft_stays_perfect_when_pipelined(tmp_path, smollm2_dir, graphed, monkeypatch):
    """Each pipelined verify runs at the kv_len, positions and attention prefix the step
    before it left on the device, for the rows of the requests still running after two
    end: any slip there and a perfect draft stops being accepted."""
    counts: dict = {}
    eng = perfect_engine("EAGLE3", tmp_path, smollm2_dir, "tree")
    _pipeline(eng, graphed, max_bs=4)
    count_calls(eng.scheduler.spec, "_launch", counts, monkeypatch)
    count_calls(eng.scheduler.spec, "drain", counts, monkeypatch)
    params = [_greedy(1 + 4 * n) for n in (10, 6, 8)]  # 1 from prefill + n verifies of 4, all pipelined
    plain = engine(tmp_path / "target", smollm2_dir)
    outs = run(eng, prompts(3, seed=2), params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in run(plain, prompts(3, seed=2), params)]
    assert min(o["meta_info"]["spec_accept_length"] for o in outs) > 3.5
    assert counts["_launch"] >= 5 and counts.get("drain", 0) == 0, counts


def test_a_stop_token_inside_a_step_drops_its_place_in_the_next(tiny, smollm2_dir, monkeypatch):
    """Requests stopped (by a token of their own plain output) at different steps: the
    step in flight frees the slots it took for each and never reads its outcome."""
    target, heads, ps, ref = tiny
    counts: dict = {}
    eng = _pipelined(target, smollm2_dir, "EAGLE3", heads["EAGLE3"], monkeypatch, counts)
    params, want = [], []
    for i, r in enumerate(ref[:4]):
        stop = r[6 + 3 * i]
        params.append({"temperature": 0, "max_new_tokens": 30, "stop_token_ids": [stop]})
        want.append(r[:r.index(stop) + 1])
    outs = run(eng, ps[:4], params)
    assert [o["output_ids"] for o in outs] == want
    assert counts.get("drop", 0) >= 1, counts


def test_an_arrival_and_an_abort_while_a_step_is_in_flight(tiny, smollm2_dir, monkeypatch):
    """A request arriving is prefilled while a step is in flight, which is read back before
    the larger batch speculates; aborting a request the step in flight carries reads that
    step back first. Outputs stay exact."""
    target, heads, ps, ref = tiny
    arrival_and_abort_while_in_flight(_pipelined(target, smollm2_dir, "EAGLE3", heads["EAGLE3"], monkeypatch, {}),
                                      ps, ref)


def test_plain_steps_between_pipelined_ones(tmp_path, smollm2_dir, monkeypatch):
    """The governor turning speculation down drains the step in flight; speculation
    resumes from the draft the plain steps extended. A perfect draft stays perfect."""
    counts: dict = {}
    eng = perfect_engine("EAGLE3", tmp_path, smollm2_dir, "tree")
    _pipeline(eng, True, max_bs=4)
    count_calls(eng.scheduler.spec, "_launch", counts, monkeypatch)
    gov = eng.scheduler.spec.governor = SomePlain(plain_run=1)
    params = _greedy(41)
    plain = engine(tmp_path / "target", smollm2_dir)
    outs = run(eng, prompts(3, seed=4), params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in run(plain, prompts(3, seed=4), params)]
    assert False in gov.modes and counts["_launch"] >= 4, counts
    assert min(o["meta_info"]["spec_accept_length"] for o in outs) > 3.5


class _Recording(SpecGovernor):
    """Always speculates; keeps every step the worker records."""

    def __init__(self) -> None:
        super().__init__(True)
        self.samples: list[tuple[int, int]] = []  # (bs, tokens)

    def speculate(self, bs: int, hint: bool | None = None) -> bool:
        return True

    def record(self, bs, speculated, tokens, seconds, switched=False, drafted=True) -> None:
        self.samples.append((bs, tokens))


@pytest.mark.parametrize("graphed", [True, False])
def test_the_governor_hears_of_every_drained_step(tiny, smollm2_dir, graphed, monkeypatch):
    """Requests arriving while a step is in flight grow the batch, which drains that step
    and launches a first step that lands nothing. The drain's tokens go with that first
    step: no step is recorded empty (the very first, which lands nothing, goes unmeasured
    with the prefill after it), and every token of a speculative step but the last step's
    reaches the governor (left out, its samples were those of unbroken pipelines only, the
    cheapest steps at a large batch)."""
    target, heads, ps, ref = tiny
    counts: dict = {}
    eng = _pipelined(target, smollm2_dir, "EAGLE3", heads["EAGLE3"], monkeypatch, counts, graphed)
    count_calls(eng.scheduler.spec, "drain", counts, monkeypatch)
    gov = eng.scheduler.spec.governor = _Recording()
    sched, outs = eng.scheduler, []
    params = [_greedy(30 - 4 * (i % 3)) for i in range(8)]
    for half in (range(4), range(4, 8)):  # the second half arrives while a step is in flight
        for i in half:
            outs += sched.add_request(GenerateReq(f"r{i}", ps[i], make_sampling_params(params[i])))
        outs += step_until(sched, lambda: sched.spec.in_flight)
    outs += step_until(sched, lambda: not sched.has_work)
    got = collect(outs)
    assert [got[f"r{i}"] for i in range(8)] == [r[:p["max_new_tokens"]] for r, p in zip(ref, params)]
    assert counts["drain"] >= 1, counts
    drafted = sum(len(ids) - 1 for ids in got.values())  # the first token of each came from its prefill
    recorded = [tokens for _, tokens in gov.samples]
    assert 0 not in recorded, recorded
    assert counts["_land"] >= len(recorded) and sum(recorded) < drafted
    assert sum(recorded) >= drafted - 2 * 8 * 5  # at most the last two steps' tokens (8 requests x 5)
    clean(eng)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captured CUDA graphs")
def test_captured_step_graphs_are_token_identical(tiny, smollm2_dir, monkeypatch):
    """On CUDA the engine captures the whole-step graphs itself; batches of 1 and 3 go
    through their replays and decode as plain greedy does."""
    target, heads, ps, ref = tiny
    counts: dict = {}
    eng = engine(target, smollm2_dir, **spec_flags("EAGLE3", heads["EAGLE3"], "tree"))
    worker = eng.scheduler.spec
    assert worker.pipeline and worker.step_graphs is not None and worker.step_graphs.graphs
    count_calls(worker, "_launch_graphed", counts, monkeypatch)
    outs = run(eng, ps[:1], _greedy(30)) + run(eng, ps[:3], _greedy(30))
    assert [o["output_ids"] for o in outs] == ref[:1] + ref[:3]
    assert counts["_launch_graphed"] >= 4, counts
    sampled = [{"temperature": 1.0, "seed": i, "max_new_tokens": 30} for i in range(3)]
    want = [o["output_ids"] for o in run(engine(target, smollm2_dir), ps[:3], sampled)]
    assert [o["output_ids"] for o in run(eng, ps[:3], sampled)] == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captured CUDA graphs")
def test_captured_batch_tree_is_token_identical(tiny, smollm2_dir, monkeypatch):
    """The captured step graphs of 4 requests and more draft the batch tree and those
    below the main tree: 8 requests that shrink to 3 decode as plain greedy does."""
    target, heads, ps, ref = tiny
    eng = engine(target, smollm2_dir, **spec_flags("EAGLE3", heads["EAGLE3"], "tree"), **BATCH_TREE,
                 cuda_graph_max_bs=8, cuda_graph_max_prefill_tokens=512)
    assert eng.scheduler.spec.step_graphs is not None
    trees = _spy_trees(eng, monkeypatch)
    params = [_greedy(30 - 4 * (i % 3)) for i in range(8)]
    outs = run(eng, ps, params)
    assert [o["output_ids"] for o in outs] == [r[:p["max_new_tokens"]] for r, p in zip(ref, params)]
    assert {(8, 3), (3, 6)} <= trees and all((n == 3) == (b >= 4) for b, n in trees), trees


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captured CUDA graphs")
def test_captured_prefill_graphs_are_token_identical(tiny, smollm2_dir, monkeypatch):
    """On CUDA a prefill chunk replays a graph captured at its bucket's length, one
    request's or the whole batch's; plain and EAGLE-3 engines then decode as after the
    eager prefills of an engine without prefill graphs."""
    target, heads, ps, _ = tiny
    small = dict(cuda_graph_max_bs=8, cuda_graph_max_prefill_tokens=512)  # the prompts' sizes: fewer captures
    eager = engine(target, smollm2_dir, cuda_graph_max_bs=8, cuda_graph_max_prefill_tokens=0)
    assert eager.scheduler.runner.prefill_graphs is None
    want = [o["output_ids"] for o in run(eager, ps, _greedy(30))]
    for flags in ({}, spec_flags("EAGLE3", heads["EAGLE3"], "tree")):
        eng = engine(target, smollm2_dir, **small, **flags)
        graphs = eng.scheduler.runner.prefill_graphs
        assert graphs is not None and graphs.graphs
        counts: dict = {}
        count_calls(graphs, "replay", counts, monkeypatch)
        assert [run(eng, [p], _greedy(30))[0]["output_ids"] for p in ps] == want
        assert counts["replay"] == len(ps), counts
        assert [o["output_ids"] for o in run(eng, ps, _greedy(30))] == want  # one batched prefill
        assert counts["replay"] == len(ps) + 1, counts


class _Req:
    def __init__(self, out: int, seq: int, **params) -> None:
        self.params = make_sampling_params({"temperature": 0, "max_new_tokens": 100, **params})
        self.max_new_tokens, self.output_ids, self.seq_len = 100, [0] * out, seq


def test_which_steps_may_be_left_in_flight():
    steps, ctx = 3, 1000  # two more steps commit at most 8 tokens
    assert pipeline.eligible([_Req(0, 10), _Req(91, 10), _Req(0, 991)], steps, ctx)
    assert pipeline.eligible([_Req(0, 10), _Req(99, 10)], steps, ctx)  # a step that ends it on length drops it
    assert not pipeline.eligible([_Req(0, 992)], steps, ctx)  # near the context length
    assert not pipeline.eligible([_Req(0, 10), _Req(0, 10, temperature=1.0)], steps, ctx)  # a sampled walk
    assert pipeline.eligible([_Req(0, 10), _Req(0, 10, temperature=1.0)], steps, ctx, sampled=True)  # step graphs
    for limit in ({"top_p": 0.9}, {"top_k": 50}, {"min_p": 0.1}):  # filters: each node's floor in the graph
        assert pipeline.eligible([_Req(0, 10, temperature=1.0, **limit)], steps, ctx, sampled=True)
        assert not pipeline.eligible([_Req(0, 10, temperature=1.0, **limit)], steps, ctx)
    assert not pipeline.eligible([_Req(0, 10, logprobs=True)], steps, ctx)  # its logits are overwritten
    assert not pipeline.eligible([_Req(0, 10, frequency_penalty=0.5)], steps, ctx)
