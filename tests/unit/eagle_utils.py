"""Shared helpers of the EAGLE engine tests: tiny engines, prompts, perfect drafts, and
the graph-shaped (static, padded) drafting paths run eagerly on the CPU."""
from __future__ import annotations

import random

from specserve import Engine
from specserve.spec.governor import SpecGovernor
from tests.unit import perfect_draft as pd
from tests.unit.model_utils import save_tiny_hf, tiny_engine

GREEDY = {"temperature": 0, "max_new_tokens": 24}
TREES = {"chain": (3, 1, 4), "tree": (3, 2, 6)}


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def tiny_target(path):
    """A tiny random 4-layer Llama target with SmolLM2's vocabulary, saved at `path`."""
    return save_tiny_hf("llama", path, vocab_size=49152, max_position_embeddings=1024, num_hidden_layers=4)


def engine(target, smollm2_dir, **flags) -> Engine:
    return tiny_engine(target, smollm2_dir, **flags)


def spec_flags(algo: str, draft, tree: str) -> dict:
    steps, topk, n = TREES[tree]
    # the governor stays off: these tests check drafting, and on a GPU it may turn a tiny
    # model's speculation down (plain steps would then hide the acceptance under test)
    flags = {"speculative_algorithm": algo, "speculative_num_steps": steps, "speculative_adaptive": "off",
             "speculative_eagle_topk": topk, "speculative_num_draft_tokens": n}
    if draft is not None:
        flags["speculative_draft_model_path"] = str(draft)
    return flags


def clean(engine: Engine) -> None:
    assert not engine.scheduler.has_work
    engine.scheduler.kv.flush_cache()
    engine.scheduler.kv.assert_no_leak()


def run(engine: Engine, prompts: list[list[int]], params=GREEDY) -> list[dict]:
    out = engine.generate(input_ids=prompts, sampling_params=params)
    clean(engine)
    return out


def perfect_engine(kind: str, root, smollm2_dir, tree: str, **flags) -> Engine:
    target = pd.make_target(root / "target", eagle3=kind == "EAGLE3", mimo=kind == "MTP-mimo")
    if kind == "EAGLE":
        spec = spec_flags("EAGLE", pd.perfect_eagle2(root / "draft", target), tree)
    elif kind == "EAGLE3":
        spec = spec_flags("EAGLE3", pd.perfect_eagle3(root / "draft", target), tree)
    else:
        (pd.perfect_mtp_mimo if kind == "MTP-mimo" else pd.perfect_mtp_deepseek)(target)
        spec = spec_flags("EAGLE", None, tree)
    return engine(target, smollm2_dir, **spec, **flags)


def use_static_paths(engine: Engine, max_bs: int) -> None:
    """Give the proposer the padded, fixed-shape drafting and draft-extend paths that CUDA
    graphs capture, uncaptured (the same static buffers, padding and indexing)."""
    from specserve.spec.eagle.backlog import RING
    from specserve.spec.tree.extend_graphs import DraftExtendGraphs
    from specserve.spec.tree.graphs import TreeDraftGraphs

    p = engine.scheduler.spec.proposer
    engine.scheduler.spec.step_graphs = None  # captured over the graphs replaced here
    runner = engine.scheduler.runner
    hidden = runner.model.config.hidden_size
    width = hidden * len(p.model.aux_layers) if p.model.feature_mode == "aux" else hidden
    p.tree.graphs = TreeDraftGraphs(p.tree, p.roots, max_bs, p.max_nodes, runner.device, capture=False)
    if p.batch_tree is not None:
        p.batch_tree.graphs = TreeDraftGraphs(p.batch_tree, p.roots, max_bs, p.batch_nodes, runner.device,
                                              capture=False)
    p.extend_graphs, p.catchup_graphs = (
        DraftExtendGraphs(p.model, p.backend, p.pool, engine.scheduler.kv.table.table, max_bs, n, width, p.topk,
                          p.token_map, p.roots, capture=False) for n in (p.extend_len, RING))


def use_step_graphs(engine: Engine, max_bs: int, exact: int = 8) -> None:
    """Pipeline greedy steps through the whole-step graph's body (spec/eagle/step_graphs.py), run
    eagerly over the static drafting paths (`use_static_paths`); batches above `exact`
    requests run padded to the next of the graphs' sizes."""
    from specserve.spec.eagle.step_graphs import StepGraphs

    use_static_paths(engine, max_bs)
    sched = engine.scheduler
    sched.spec.pipeline = True
    sched.spec.step_graphs = StepGraphs(sched.runner, sched.spec.proposer, sched.kv, max_bs, capture=False,
                                        exact=exact)


def count_calls(obj, name: str, counts: dict, monkeypatch) -> None:
    """Count calls of obj.name into counts[name], calling through."""
    real = getattr(obj, name)

    def counted(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return real(*args, **kwargs)
    monkeypatch.setattr(obj, name, counted)


class SomePlain(SpecGovernor):
    """A governor that runs two steps speculatively, then `plain_run` plainly, and again."""

    def __init__(self, plain_run: int = 1) -> None:
        super().__init__(True)
        self.period, self.modes = 2 + plain_run, []

    def speculate(self, bs: int, hint: bool | None = None) -> bool:
        self.modes.append(len(self.modes) % self.period < 2)
        return self.modes[-1]


def step_until(sched, done, limit: int = 200) -> list:
    """The scheduler's outputs, stepping it until done() (at most `limit` steps)."""
    outs = []
    for _ in range(limit):
        if done():
            return outs
        outs += sched.step()
    raise AssertionError("the scheduler did not get there")


def collect(outs: list) -> dict[str, list[int]]:
    """Token ids per request id from scheduler outputs."""
    got: dict[str, list[int]] = {}
    for out in outs:
        got.setdefault(out.rid, []).extend(out.token_ids)
    return got


def arrival_and_abort_while_in_flight(eng: Engine, prompts: list[list[int]], ref: list[list[int]]) -> None:
    """Request "a" runs until a step is in flight; "b" arrives (prefilled while it is) and is
    aborted once a step in flight carries it (which reads that step back first): a's
    output is plain decoding's `ref[0]`, b's its prefix, no step left in flight, no slot."""
    from specserve.core.messages import GenerateReq
    from specserve.offline import make_sampling_params

    sched = eng.scheduler
    params = make_sampling_params({"temperature": 0, "max_new_tokens": 30})
    outs = sched.add_request(GenerateReq("a", prompts[0], params))
    outs += step_until(sched, lambda: sched.spec.in_flight)
    outs += sched.add_request(GenerateReq("b", prompts[1], params))
    outs += step_until(sched, lambda: any(r.rid == "b" and sched.spec.holds(r) for r in sched.running))
    outs += sched.abort("b")
    assert not any(r.rid == "b" for r in sched.running)
    outs += step_until(sched, lambda: not sched.has_work)
    got = collect(outs)
    assert got["a"] == ref[0]
    assert got["b"] == ref[1][:len(got["b"])] and len(got["b"]) < 30  # aborted part-way, exact so far
    assert not sched.spec.in_flight
    clean(eng)
