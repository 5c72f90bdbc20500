"""Prefill CUDA graphs against eager forwards: the target's (runner/prefill_graphs.py) and
EAGLE's draft prefill (spec/eagle/prefill_graphs.py), one request's chunk or a batch's.

On CUDA the graphs are captured and replayed; on a CPU the same padded bodies run eagerly
with the Triton kernels interpreted. Each check runs a graphed and an eager runner over the
same model, allocating the same slots in the same order, and compares logits (or root
states), features and every K/V slot but the scratch slot 0, where padding rows write.
"""
from __future__ import annotations

import torch

from specserve.attention.triton_backend import TritonBackend  # noqa: E402
from specserve.core.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402
from specserve.spec.eagle import LAYOUTS  # noqa: E402
from tests.unit.model_utils import BareRunner, save_tiny_hf  # noqa: E402
from tests.unit.triton_interp import DEV  # first: sets TRITON_INTERPRET before triton is imported

ROWS = 8  # table rows of a BareRunner


def _target_pair(tmp_path, **graph_args):
    """(model, eager runner, graphed runner, its PrefillGraphs up to 32 tokens) over one tiny
    Llama whose aux layers 1 and 2 are the features."""
    from specserve.runner.prefill_graphs import PrefillGraphs

    path = save_tiny_hf("llama", tmp_path / "m")
    with torch.device(DEV):
        model = load_model(path, torch.float32, DEV)
        model.aux_layers = (1, 2)
        eager, graphed = BareRunner(model), BareRunner(model)
    for r in (eager, graphed):
        r.backend = TritonBackend(DEV)
    zeros = torch.zeros(1, dtype=torch.int64, device=DEV)
    template = ForwardBatch(ForwardMode.EXTEND, zeros, zeros, zeros, zeros, [0], [1], graphed.table.table,
                            graphed.pool, graphed.backend)
    with torch.inference_mode():
        graphs = PrefillGraphs(model, graphed.backend, 512, 32, template, "aux", capture=DEV.type == "cuda",
                               **graph_args)
    return model, eager, graphed, graphs


def _draft_pair(tmp_path, max_tokens: int, **graph_args):
    """(EAGLE-3 draft, eager runner, graphed runner, root states, its DraftPrefillGraphs)."""
    from specserve.models.draft_layouts import save_eagle3
    from specserve.models.draft_loader import load_draft
    from specserve.spec.eagle.prefill_graphs import DraftPrefillGraphs
    from specserve.spec.tree.root_states import RootStates

    path = save_tiny_hf("llama", tmp_path / "m")
    target = load_model(path, torch.float32, DEV)
    draft = load_draft(save_eagle3(tmp_path / "e3", path, draft_vocab=96, aux_ids=[-1, 0, 1]), target, LAYOUTS["EAGLE3"],
                       torch.float32, DEV)
    eager, graphed = BareRunner(draft), BareRunner(draft)
    graphed.backend = TritonBackend(DEV)
    hidden = draft.config.hidden_size
    roots = RootStates(ROWS, 3, hidden, torch.float32, DEV)
    with torch.inference_mode():
        graphs = DraftPrefillGraphs(draft, graphed.backend, graphed.pool, graphed.table.table, max_tokens, 3 * hidden,
                                    3, draft.token_map, roots, capture=DEV.type == "cuda", **graph_args)
    return draft, eager, graphed, roots, graphs


def _assert_same_kv(graphed: BareRunner, eager: BareRunner, layers: int) -> None:
    """Every slot's K/V agree but the scratch slot 0's, where padding rows write."""
    for layer in range(layers):
        for a, b in ((graphed.pool.k[layer], eager.pool.k[layer]), (graphed.pool.v[layer], eager.pool.v[layer])):
            torch.testing.assert_close(a[1:], b[1:], rtol=1e-4, atol=1e-4)


def _assert_same_root(roots, row: int, want) -> None:
    """Row `row` of the root states holds `want` (top-k log-probabilities, ids, next hidden)."""
    torch.testing.assert_close(roots.logp[row:row + 1], want[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(roots.ids[row:row + 1], want[1])
    torch.testing.assert_close(roots.hidden[row:row + 1], want[2], rtol=1e-4, atol=1e-4)


def test_prefill_graph_equals_eager_forward(tmp_path):
    """One request's prefill through its bucket's graph against the eager forward: a
    20-token chunk padded to 32 rows, then 5 more over the cached 20 padded to 16. The last
    row's logits, every row's features and K/V agree; padding rows wrote nothing but the
    scratch slot 0."""
    model, eager, graphed, graphs = _target_pair(tmp_path)
    assert graphs.sizes == [16, 32]
    tokens = [(7 * i + 3) % 512 for i in range(25)]
    for prefix, chunk in ((0, tokens[:20]), (20, tokens[20:])):
        fbs = [_prefill_batch(r, prefix, chunk) for r in (eager, graphed)]
        assert graphs.can_run(fbs[1])
        with torch.inference_mode():
            eager.backend.init_forward_metadata(fbs[0])
            hidden, aux = model(fbs[0])
            want = model.compute_logits(hidden[-1:]), torch.cat(aux, dim=-1)
            got = graphs.replay(fbs[1])
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    _assert_same_kv(graphed, eager, model.config.num_layers)


def test_batched_prefill_graph_equals_eager_forward(tmp_path):
    """Several requests' prefill chunks through graphs of up to 20 requests: first three
    fresh prompts (the middle one a chunk that samples nothing) in 32 rows, then a pair
    over their cached prefixes in 16 rows (18 padding requests, more than the rows),
    against eager forwards. Logits of the sampled rows, every row's features and K/V
    agree; padding wrote only the scratch slot 0. A 21st request or a prompt's every-row
    logits (prompt logprobs) are not the graph's."""
    model, eager, graphed, graphs = _target_pair(tmp_path, max_reqs=20)
    assert graphs.req_sizes == [1, 20] and (16, 20) in graphs.keys
    tok = lambda n, k: [(7 * i + k) % 512 for i in range(n)]  # noqa: E731
    first = [(1, 0, tok(9, 1), True), (2, 0, tok(12, 2), False), (3, 0, tok(6, 3), True)]
    second = [(2, 12, tok(3, 4), True), (1, 9, tok(2, 5), True)]
    for reqs in (first, second):
        fbs = [_prefill_many(r, reqs) for r in (eager, graphed)]
        assert graphs.can_run(fbs[1])
        with torch.inference_mode():
            eager.backend.init_forward_metadata(fbs[0])
            hidden, aux = model(fbs[0])
            want = model.compute_logits(hidden[fbs[0].logit_rows]), torch.cat(aux, dim=-1)
            got = graphs.replay(fbs[1])
        assert got[0].shape == want[0].shape
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    _assert_same_kv(graphed, eager, model.config.num_layers)
    too_many = _prefill_many(graphed, [(r % 8, 0, [1], True) for r in range(21)])
    assert not graphs.can_run(too_many)
    every_row = _prefill_many(graphed, [(1, 0, tok(6, 6), True)])
    every_row.logit_rows = torch.arange(6, device=DEV)
    assert not graphs.can_run(every_row)


def test_draft_prefill_graph_equals_eager_extend(tmp_path):
    """EAGLE-3's draft extend over a prefill chunk through its bucket's graph against the
    eager draft extend: a middle chunk of 20 tokens padded to 32 (its root state goes to the
    scratch row), then the final 5 over the cached 20 padded to 16. The root state (top-k
    log-probabilities, ids, next hidden) and the draft's K/V agree; padding wrote only slot 0."""
    from specserve.spec.tree.draft import top_children

    draft, eager, graphed, roots, graphs = _draft_pair(tmp_path, 32)
    assert graphs.sizes == [16, 32] and graphs.can_run(32) and not graphs.can_run(33)
    g = torch.Generator().manual_seed(0)
    tokens = [(7 * i + 3) % 512 for i in range(25)]
    features = torch.randn(25, 3 * draft.config.hidden_size, generator=g).to(DEV)
    for prefix, n, final in ((0, 20, False), (20, 5, True)):
        chunk, feats = tokens[prefix:prefix + n], features[prefix:prefix + n]
        with torch.inference_mode():
            h_logits, h_next = draft(_draft_extend_batch(eager, prefix, chunk), feats)
            want = (*top_children(draft.compute_logits(h_logits[-1:]), 3, draft.token_map), h_next[-1:])
            slots = graphed.slots(n)
            graphed.table.write(0, prefix, slots)
            graphs.run([(chunk, prefix, 0, 0 if final else None)], slots, feats)
        _assert_same_root(roots, 0 if final else roots.scratch_row, want)
        if not final:  # a middle chunk leaves the request's row alone
            assert not roots.hidden[0].any()
    _assert_same_kv(graphed, eager, 1)


def test_batched_draft_prefill_graph_equals_eager_extend(tmp_path):
    """One draft prefill graph over three requests' chunks (7 + 5 + 3 tokens padded to 16,
    three requests to four): each final chunk's root state and every request's draft K/V
    are those of its own eager draft extend; the middle chunk's request (row 1) keeps no
    state, and the padding request writes only the scratch row and slot 0."""
    from specserve.spec.tree.draft import top_children

    draft, eager, graphed, roots, graphs = _draft_pair(tmp_path, 16, max_reqs=4)
    assert graphs.keys == [(16, 1), (16, 4)] and graphs.can_run(16, 4) and not graphs.can_run(16, 5)
    g = torch.Generator().manual_seed(1)
    reqs = [(0, [(5 * i + 2) % 512 for i in range(7)], True), (1, [(3 * i + 1) % 512 for i in range(5)], False),
            (2, [(11 * i + 4) % 512 for i in range(3)], True)]
    features = torch.randn(15, 3 * draft.config.hidden_size, generator=g).to(DEV)
    feats = features.split([len(c) for _, c, _ in reqs])
    want = {}
    with torch.inference_mode():
        for (row, chunk, final), f in zip(reqs, feats):
            h_logits, h_next = draft(_draft_extend_batch(eager, 0, chunk, row), f)
            if final:
                want[row] = (*top_children(draft.compute_logits(h_logits[-1:]), 3, draft.token_map), h_next[-1:])
        slots = []
        for row, chunk, _ in reqs:
            slots.append(graphed.slots(len(chunk)))
            graphed.table.write(row, 0, slots[-1])
        graphs.run([(chunk, 0, row, row if final else None) for row, chunk, final in reqs], torch.cat(slots), features)
    for row, w in want.items():
        _assert_same_root(roots, row, w)
    assert not roots.hidden[1].any() and not roots.hidden[3].any()  # a middle chunk; no request
    _assert_same_kv(graphed, eager, 1)


def _draft_extend_batch(runner: BareRunner, prefix: int, chunk: list[int], row: int = 0) -> ForwardBatch:
    """A DRAFT_EXTEND batch of one request (table row `row`) over its next len(chunk) positions."""
    slots = runner.slots(len(chunk))
    runner.table.write(row, prefix, slots)
    n = len(chunk)
    fb = ForwardBatch(ForwardMode.DRAFT_EXTEND, torch.tensor(chunk, device=DEV), torch.arange(prefix, prefix + n,
                      device=DEV), slots.to(DEV), torch.tensor([row], dtype=torch.int64, device=DEV), [prefix], [n],
                      runner.table.table, runner.pool, runner.backend, logit_rows=torch.tensor([n - 1], device=DEV))
    runner.backend.init_forward_metadata(fb)
    return fb


def _prefill_batch(runner: BareRunner, prefix: int, chunk: list[int]) -> ForwardBatch:
    """An EXTEND batch of one request (table row 0) whose logits are wanted at its last token."""
    return _prefill_many(runner, [(0, prefix, chunk, True)])


def _prefill_many(runner: BareRunner, reqs: list[tuple[int, int, list[int], bool]]) -> ForwardBatch:
    """An EXTEND batch of requests (table row, cached prefix, new tokens, sampled: logits
    wanted at its last token)."""
    ids, positions, slots, logit_rows, t = [], [], [], [], 0
    for row, prefix, chunk, sampled in reqs:
        s = runner.slots(len(chunk))
        runner.table.write(row, prefix, s)
        ids += chunk
        positions += range(prefix, prefix + len(chunk))
        slots.append(s)
        t += len(chunk)
        if sampled:
            logit_rows.append(t - 1)
    return ForwardBatch(ForwardMode.EXTEND, torch.tensor(ids, device=DEV), torch.tensor(positions, device=DEV),
                        torch.cat(slots).to(DEV), torch.tensor([r[0] for r in reqs], device=DEV),
                        [r[1] for r in reqs], [len(r[2]) for r in reqs], runner.table.table, runner.pool,
                        runner.backend, logit_rows=torch.tensor(logit_rows, dtype=torch.int64, device=DEV))
