"""Speculative decoding through the real engine: NGRAM and STANDALONE are lossless.

Greedy output must be token-identical to the same engine without speculation, at batch
sizes 1 and 8, for several tree settings. A draft that *is* the target must be accepted
almost always (this proves the wiring: wrong positions or slots collapse acceptance
without breaking greedy equality); a random draft must still be exactly right.
"""
from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.models.draft_layouts import save_eagle2, save_eagle3
from tests.unit.model_utils import EXACT_ON_GPU, save_tiny_hf

pytestmark = pytest.mark.slow

PROMPTS = [
    "List 3 countries and their capitals.",
    "Repeat this sentence exactly three times: the quick brown fox jumps over the lazy dog.",
    "Rewrite this code with better names: def f(a, b): return [x for x in a if x in b]",
    "Count from one to twenty, separated by commas.",
    "What is the capital of France?",
    "Write the alphabet in capital letters, separated by spaces.",
    "Give me three tips for learning to cook.",
    "Copy this list: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry.",
]
GREEDY = {"temperature": 0, "max_new_tokens": 32}
# the governor stays off: on a GPU it may turn speculation down, hiding the acceptance under test
FIXED = {"speculative_adaptive": "off"}


def _ids(engine: Engine, prompts: list[str]) -> list[list[int]]:
    return [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]


def _clean(engine: Engine) -> None:
    assert not engine.scheduler.has_work
    engine.scheduler.kv.flush_cache()
    engine.scheduler.kv.assert_no_leak()


@pytest.fixture(scope="module")
def reference(smollm2_engine) -> list[list[int]]:
    """Plain greedy outputs of the eight prompts (batch 8), computed once."""
    outs = smollm2_engine.generate(input_ids=_ids(smollm2_engine, PROMPTS), sampling_params=GREEDY)
    _clean(smollm2_engine)
    return [o["output_ids"] for o in outs]


def _check(engine: Engine, reference: list[list[int]], batch_sizes=(1, 8)) -> list[dict]:
    ids = _ids(engine, PROMPTS)
    results = []
    if 1 in batch_sizes:
        for i in (0, 1):
            r = engine.generate(input_ids=ids[i], sampling_params=GREEDY)
            assert r["output_ids"] == reference[i], PROMPTS[i]
            results.append(r)
            _clean(engine)
    if 8 in batch_sizes:
        outs = engine.generate(input_ids=ids, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == reference
        results += outs
        _clean(engine)
    return results


@pytest.mark.parametrize("flags", [
    {},  # reference defaults: 12 draft tokens, BFS breadth up to 10
    {"speculative_num_draft_tokens": 4, "speculative_ngram_max_bfs_breadth": 1},
    {"speculative_ngram_match_type": "PROB", "speculative_num_draft_tokens": 8, "chunked_prefill_size": 16},
])
def test_ngram_greedy_is_token_identical(smollm2_dir, reference, flags):
    engine = Engine(str(smollm2_dir), log_level="warning", **EXACT_ON_GPU, **FIXED, speculative_algorithm="NGRAM", **flags)
    results = _check(engine, reference)
    meta = results[1]["meta_info"]  # the repetitive prompt: n-gram drafting must pay there
    assert meta["spec_verify_ct"] < len(results[1]["output_ids"])
    assert meta["spec_accept_length"] > 1.2


@pytest.mark.parametrize("tree", [{}, {"speculative_num_steps": 3, "speculative_eagle_topk": 2,
                                      "speculative_num_draft_tokens": 6}])
def test_standalone_with_the_target_as_draft_accepts_everything(smollm2_dir, reference, tree):
    """Auto defaults (3, 1, 4) chain, and a topk-2 tree: depth 3 bounds accept length at 4.

    With a self-draft a branch that attended to the wrong ancestors would mispredict, so
    acceptance near the bound also checks the tree drafter's per-branch rows."""
    engine = Engine(str(smollm2_dir), log_level="warning", **EXACT_ON_GPU, **FIXED, speculative_algorithm="STANDALONE",
                    speculative_draft_model_path=str(smollm2_dir), **tree)
    results = _check(engine, reference)
    lengths = [r["meta_info"]["spec_accept_length"] for r in results]
    assert min(lengths) >= 3.0, lengths  # a short answer's last verify may be cut by max_tokens
    assert engine.scheduler.spec.stats.avg_accept_length > 3.0


@pytest.mark.parametrize("steps,topk,n", [(1, 1, 2), (3, 4, 8)])  # a 5-step chain: the stops test
def test_standalone_with_a_random_draft_is_still_exact(smollm2_dir, reference, tmp_path, steps, topk, n):
    draft = save_tiny_hf("llama", tmp_path / "draft", vocab_size=49152, max_position_embeddings=8192)
    engine = Engine(str(smollm2_dir), log_level="warning", **EXACT_ON_GPU, **FIXED, speculative_algorithm="STANDALONE",
                    speculative_draft_model_path=str(draft), speculative_num_steps=steps,
                    speculative_eagle_topk=topk, speculative_num_draft_tokens=n)
    results = _check(engine, reference, batch_sizes=(8,))
    assert all(r["meta_info"]["spec_accept_length"] < 1.5 for r in results)


def test_standalone_with_dummy_draft_weights_is_exact(smollm2_dir, reference, tmp_path):
    """--speculative-draft-load-format dummy: the draft's config with random weights (its
    safetensors are never read: here they are deleted first)."""
    draft = save_tiny_hf("llama", tmp_path / "draft", vocab_size=49152, max_position_embeddings=8192)
    for weights in draft.glob("*.safetensors"):
        weights.unlink()
    engine = Engine(str(smollm2_dir), log_level="warning", **EXACT_ON_GPU, **FIXED, speculative_algorithm="STANDALONE",
                    speculative_draft_model_path=str(draft), speculative_draft_load_format="dummy")
    results = _check(engine, reference, batch_sizes=(8,))
    assert all(r["meta_info"]["spec_accept_length"] < 1.5 for r in results)


def test_the_kv_budget_counts_a_draft_llms_pool():
    """A STANDALONE draft keeps a KV slot for each of the target's: on a GPU the budget
    divides memory by both pools' bytes a slot (counting the target's alone, the draft's
    pool ran out of memory at start-up)."""
    from types import SimpleNamespace

    from specserve.cache.kv_pool import KVPool
    from specserve.core.config import CacheConfig
    from specserve.runner.model_runner import ModelRunner

    target = SimpleNamespace(num_layers=30, num_kv_heads=3, kv_heads_per_rank=3, head_dim=64)
    seen = []
    runner = SimpleNamespace(model=SimpleNamespace(config=target), dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                             device=torch.device("cuda"), draft_kv_shape=(4, 2, 128),
                             context_length=1024, _gpu_budget=lambda cache, per_slot: seen.append(per_slot) or 10**6)
    runner._draft_bytes_per_slot = lambda: ModelRunner._draft_bytes_per_slot(runner)
    assert ModelRunner._kv_budget(runner, CacheConfig()) == 10**6
    assert seen == [KVPool.bytes_per_slot(30, 3, 64, torch.bfloat16) + KVPool.bytes_per_slot(4, 2, 128, torch.bfloat16)]


@pytest.mark.parametrize("graph_shaped", [False, True])
def test_standalone_with_a_token_map_drafts_from_it_and_stays_exact(smollm2_dir, reference, tmp_path, graph_shaped):
    """FR-Spec (--speculative-token-map) with the target as its own draft, a (3, 2, 6) tree:
    the draft's lm_head keeps the map's rows (shuffled, so a pick must be mapped back to
    its token id). A map holding every token of the answers keeps acceptance at the depth
    bound; one without them leaves only roots accepted; both stay token-identical."""
    answers = sorted({t for out in reference for t in out})
    rest = [t for t in range(49152) if t not in set(answers)]
    g = torch.Generator().manual_seed(0)
    maps = [("hot", answers + rest[:4000], 3.0)] + ([] if graph_shaped else [("cold", rest[:4000], None)])
    for name, ids, accepted in maps:
        ids = [ids[i] for i in torch.randperm(len(ids), generator=g).tolist()]
        torch.save(ids, tmp_path / f"{name}.pt")
        engine = Engine(str(smollm2_dir), log_level="warning", **EXACT_ON_GPU, **FIXED,
                        speculative_algorithm="STANDALONE", speculative_draft_model_path=str(smollm2_dir),
                        speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6,
                        speculative_token_map=str(tmp_path / f"{name}.pt"))
        p = engine.scheduler.spec.proposer
        assert p.model.lm_head.weight.shape[0] == len(ids) and p.token_map.tolist() == ids
        if graph_shaped:
            _graph_shaped(engine, max_bs=8)
        results = _check(engine, reference, batch_sizes=(1, 8) if name == "hot" and not graph_shaped else (8,))
        lengths = [r["meta_info"]["spec_accept_length"] for r in results]
        if accepted is not None:
            assert min(lengths) >= accepted, lengths
        else:
            assert max(lengths) < 1.01, lengths  # no draft is ever a token of the answers
        engine.shutdown()


def _graph_shaped(engine: Engine, max_bs: int = 8) -> None:
    """Give a STANDALONE proposer the padded catch-up and tree-pass paths its CUDA graphs
    capture, run eagerly (the same static buffers, padding and table-index slots)."""
    from specserve.spec.tree.extend_graphs import DraftExtendGraphs
    from specserve.spec.tree.graphs import TreeDraftGraphs

    p = engine.scheduler.spec.proposer
    p.extend_graphs = DraftExtendGraphs(p.model, p.backend, p.pool, p.table, max_bs, p.catch_up_len, 0, p.topk,
                                        p.token_map, p.roots, capture=False, table_slots=True)
    if p.tree is not None:
        p.tree.graphs = TreeDraftGraphs(p.tree, p.roots, max_bs, p.max_nodes, p.runner.device, capture=False)


@pytest.mark.parametrize("tree", [(3, 1, 4), (3, 2, 6)])
def test_standalone_graph_shaped_drafting_reads_nothing_back(smollm2_dir, reference, tree, monkeypatch):
    """The catch-up padded to num_steps + 1 tokens (slots gathered from the table on the
    device) and the tree pass over static buffers: still token-identical, a self-draft
    still accepted at the depth bound, and no step reads the table back to the host."""
    from specserve.cache.req_table import ReqToTokenTable

    steps, topk, n = tree
    engine = Engine(str(smollm2_dir), log_level="warning", **EXACT_ON_GPU, **FIXED, speculative_algorithm="STANDALONE",
                    speculative_draft_model_path=str(smollm2_dir), speculative_num_steps=steps,
                    speculative_eagle_topk=topk, speculative_num_draft_tokens=n)
    _graph_shaped(engine, max_bs=4)  # batches of 5-8 catch up eagerly, 3 pads to 4
    p, calls = engine.scheduler.spec.proposer, {"graphed": 0, "eager": 0}
    # a step drafted ahead (the pipeline, on a GPU) replays the catch-up graph in draft_ahead
    for name, key in (("_catch_up_graphed", "graphed"), ("draft_ahead", "graphed"), ("_catch_up_eager", "eager")):
        real = getattr(p, name)
        monkeypatch.setattr(p, name, lambda *a, real=real, key=key: (calls.__setitem__(key, calls[key] + 1), real(*a))[1])
    proposing, propose, read = [False], p.propose, ReqToTokenTable.read

    def propose_checked(*args):
        proposing[0] = True
        try:
            return propose(*args)
        finally:
            proposing[0] = False

    def read_checked(*args):
        assert not proposing[0], "a draft step read the table back"
        return read(*args)
    monkeypatch.setattr(p, "propose", propose_checked)
    monkeypatch.setattr(ReqToTokenTable, "read", read_checked)
    results = _check(engine, reference)
    assert min(r["meta_info"]["spec_accept_length"] for r in results) >= 3.0
    assert calls["graphed"] > 10 and calls["eager"] > 0  # prompts catch up eagerly, verifies through the graph


def test_standalone_catches_up_after_plain_steps_in_rounds_of_the_graph(smollm2_dir, reference, monkeypatch):
    """Plain steps (the governor's) leave the draft behind by their tokens: a catch-up of
    up to CATCH_UP_ROUNDS replays' worth runs through the graph-shaped path in rounds of L
    tokens, each round's requests those with tokens left, and stays token-identical."""
    from specserve.spec.standalone import proposer as standalone

    engine = Engine(str(smollm2_dir), log_level="warning", **EXACT_ON_GPU, **FIXED, speculative_algorithm="STANDALONE",
                    speculative_draft_model_path=str(smollm2_dir), speculative_num_steps=3,
                    speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    _graph_shaped(engine, max_bs=8)
    worker = engine.scheduler.spec
    p, chunks, steps = worker.proposer, [], [0]

    def speculate(bs, hint=None):  # two speculative steps, then a stretch of 1 to 9 plain ones
        steps[0] += 1
        return steps[0] % 11 in (0, 1, 5, 6)
    monkeypatch.setattr(worker.governor, "speculate", speculate)
    real = p._catch_up_graphed
    monkeypatch.setattr(p, "_catch_up_graphed", lambda reqs, spans: (chunks.append(spans), real(reqs, spans))[1])
    _check(engine, reference)
    assert all(e - s <= p.catch_up_len for spans in chunks for s, e in spans)
    rounds = [spans for spans in chunks if any(e - s == p.catch_up_len for s, e in spans)]
    assert len(rounds) > 3, chunks  # spans longer than L were fed L at a time
    assert standalone.CATCH_UP_ROUNDS * p.catch_up_len > 9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the sync check need a GPU")
@pytest.mark.parametrize("tree", [(3, 1, 4), (3, 2, 6), (5, 1, 6)])
def test_standalone_on_cuda_replays_graphs_and_never_syncs_while_drafting(smollm2_dir, reference, tree, monkeypatch):
    """The captured catch-up and tree-pass graphs, greedy steps pipelined (drafted ahead
    before each verify's read-back): token-identical, a self-draft accepted at the depth
    bound, and neither a proposal nor a draft-ahead synchronises with the GPU (torch's
    sync debug mode turns any synchronising call into an error)."""
    steps, topk, n = tree
    small = {"cuda_graph_max_bs": 8, "cuda_graph_max_prefill_tokens": 512}  # the batches here: fewer captures
    engine = Engine(str(smollm2_dir), log_level="warning", **(EXACT_ON_GPU | small), **FIXED,
                    speculative_algorithm="STANDALONE", speculative_draft_model_path=str(smollm2_dir),
                    speculative_num_steps=steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=n)
    worker, p = engine.scheduler.spec, engine.scheduler.spec.proposer
    assert p.extend_graphs is not None and p.tree.graphs is not None and worker.pipeline
    calls = {"draft_ahead": 0}
    for name in ("propose", "draft_ahead"):
        real = getattr(p, name)

        def checked(*args, real=real, name=name):
            calls[name] = calls.get(name, 0) + 1
            torch.cuda.set_sync_debug_mode("error")
            try:
                return real(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        monkeypatch.setattr(p, name, checked)
    results = _check(engine, reference)
    assert min(r["meta_info"]["spec_accept_length"] for r in results) >= 3.0  # a short answer's last verify is cut
    assert engine.scheduler.spec.stats.avg_accept_length > 0.75 * min(steps + 1, n)  # the depth bound
    assert calls["draft_ahead"] > 10, calls


@pytest.mark.parametrize("algo,steps,topk,n", [("EAGLE", 3, 1, 4), ("EAGLE3", 3, 2, 6)])
def test_eagle_heads_on_smollm2_are_exact(smollm2_dir, reference, tmp_path, algo, steps, topk, n):
    """Random heads of the real layout and size (EAGLE-3 with a 32k draft vocabulary)."""
    if algo == "EAGLE":
        head = save_eagle2(tmp_path / "head", smollm2_dir, bias=True, scale=0.02)
    else:
        head = save_eagle3(tmp_path / "head", smollm2_dir, draft_vocab=32000, scale=0.02)
    engine = Engine(str(smollm2_dir), log_level="warning", **EXACT_ON_GPU, **FIXED, speculative_algorithm=algo,
                    speculative_draft_model_path=str(head), speculative_num_steps=steps,
                    speculative_eagle_topk=topk, speculative_num_draft_tokens=n)
    _check(engine, reference, batch_sizes=(8,))  # batch 1 on the real model: test_shipped_head.py


def test_stops_and_max_tokens_inside_an_accepted_run(smollm2_dir):
    plain = Engine(str(smollm2_dir), log_level="warning", **EXACT_ON_GPU)
    spec = Engine(str(smollm2_dir), log_level="warning", **EXACT_ON_GPU, **FIXED, speculative_algorithm="STANDALONE",
                  speculative_draft_model_path=str(smollm2_dir), speculative_num_steps=5,
                  speculative_eagle_topk=1, speculative_num_draft_tokens=6)
    ids = _ids(plain, PROMPTS[:1])[0]
    for params in ({"stop": [" Mosc"]}, {"max_new_tokens": 7}, {"stop_token_ids": [42]}, {"stop": ["Beijing"]}):
        p = {"temperature": 0, "max_new_tokens": 64, **params}
        a, b = plain.generate(input_ids=ids, sampling_params=p), spec.generate(input_ids=ids, sampling_params=p)
        assert (b["text"], b["output_ids"]) == (a["text"], a["output_ids"]), params
        assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"]
        _clean(spec)
    full = spec.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 64})
    assert full["output_ids"][-1] == 2 and len(full["output_ids"]) == 39  # EOS lands mid-run
    _clean(spec)


def test_seeded_sampling_with_speculation_reproduces_plain_sampling(smollm2_engine, smollm2_dir):
    """Gumbel verification: same seed, same tokens as plain sampling, whatever was drafted."""
    engine = Engine(str(smollm2_dir), log_level="warning", **EXACT_ON_GPU, **FIXED, speculative_algorithm="NGRAM")
    ids = _ids(engine, PROMPTS[7:8])[0]
    p = {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 32, "seed": 7}
    plain = smollm2_engine.generate(input_ids=ids, sampling_params=p)
    _clean(smollm2_engine)
    a = engine.generate(input_ids=ids, sampling_params=p)
    b = engine.generate(input_ids=ids, sampling_params=p)  # the trie has learned: other drafts
    assert a["output_ids"] == b["output_ids"] == plain["output_ids"]
    assert a["meta_info"]["spec_accept_length"] > 1.0
    _clean(engine)


def test_full_verify_batches_are_exact(smollm2_dir, reference, monkeypatch):
    """With verify graphs every request's tree is padded to N nodes (padding hangs off the
    root into the scratch slot): forced here on the eager path, NGRAM's ragged trees must
    still give the plain greedy tokens."""
    from specserve.runner.model_runner import ModelRunner

    engine = Engine(str(smollm2_dir), log_level="warning", **EXACT_ON_GPU, **FIXED, speculative_algorithm="NGRAM",
                    speculative_num_draft_tokens=8)
    monkeypatch.setattr(ModelRunner, "verify_graph_tokens", property(lambda self: 8))
    results = _check(engine, reference)
    assert results[1]["meta_info"]["spec_accept_length"] > 1.2
