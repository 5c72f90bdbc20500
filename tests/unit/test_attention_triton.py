"""TritonBackend against the reference backend: decode, extend, verify, GQA, graph hooks, a model.

On CUDA the kernels run compiled (fp32 and bf16); on CPU under TRITON_INTERPRET=1, which
must be set before triton is first imported. Shapes stay small so the interpreter is quick.
Every check runs both backends on copies of one random KV pool and compares the outputs
and the pools after the forward (the new K/V at out_slots).
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")


def _patch_old_interpreter() -> None:
    """triton <= 3.6's interpreter turns loop bounds into ints with int(array of shape [1]),
    which numpy >= 2.4 rejects (triton-lang/triton#9171), so no runtime-bound loop runs.
    Apply the upstream fix (squeeze first) where it is missing; compiled kernels are unaffected."""
    import inspect

    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if "squeeze" in inspect.getsource(original):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_old_interpreter()

from specserve.attention.torch_ref import TorchRefBackend  # noqa: E402
from specserve.attention.triton_backend import TritonBackend  # noqa: E402
from specserve.cache.kv_pool import KVPool  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402
from specserve.runner.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from specserve.spec.drafts import Drafts  # noqa: E402
from tests.unit.model_utils import BareRunner, save_tiny_hf  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV.type == "cuda" else [])
NUM_SLOTS, MAX_REQS, MAX_CONTEXT, LAYER = 600, 8, 256, 1  # layer 1 of 2: per-layer indexing shows


def _tol(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def _layout(prefix_lens: list[int], extend_lens: list[int], g: torch.Generator):
    """A req_to_token table with rows 0..B-1 on random distinct slots; (table, rows, out_slots)."""
    table = torch.zeros(MAX_REQS, MAX_CONTEXT, dtype=torch.int64)
    slots = torch.randperm(NUM_SLOTS, generator=g) + 1
    out, used = [], 0
    for b, (p, n) in enumerate(zip(prefix_lens, extend_lens)):
        table[b, :p + n] = slots[used:used + p + n]
        out.append(slots[used + p:used + p + n])
        used += p + n
    return table.to(DEV), torch.arange(len(prefix_lens), device=DEV), torch.cat(out).to(DEV)


def _run(backend, pool0: KVPool, table, rows, out_slots, prefix_lens, extend_lens, qkv, masks=None,
         mode=ForwardMode.EXTEND, tail=None):
    """(output [T, H*D], pool after the forward) of one layer's attention on a copy of pool0."""
    q, k, v = qkv
    pool = KVPool(NUM_SLOTS, 2, k.shape[1], k.shape[2], k.dtype, DEV)
    for layer in range(2):
        pool.k[layer].copy_(pool0.k[layer])
        pool.v[layer].copy_(pool0.v[layer])
    zeros = torch.zeros(q.shape[0], dtype=torch.int64, device=DEV)
    fb = ForwardBatch(mode, zeros, zeros, out_slots, rows, prefix_lens, extend_lens, table, pool, backend,
                      custom_masks=masks, draft_tail=tail)
    backend.init_forward_metadata(fb)
    return backend.forward(q, k, v, LAYER, fb, q.shape[2] ** -0.5), pool


def _check(prefix_lens, extend_lens, heads, kv_heads, dim, dtype=torch.float32, masks=None,
           mode=ForwardMode.EXTEND, layout=None, splits=None, seed=0) -> None:
    g = torch.Generator().manual_seed(seed)
    table, rows, out_slots = layout or _layout(prefix_lens, extend_lens, g)
    pool0 = KVPool(NUM_SLOTS, 2, kv_heads, dim, dtype, DEV)
    for t in pool0.k + pool0.v:
        t.copy_(torch.randn(t.shape, generator=g))
    total = sum(extend_lens)
    qkv = [torch.randn(total, h, dim, generator=g).to(DEV, dtype) for h in (heads, kv_heads, kv_heads)]
    ref, ref_pool = _run(TorchRefBackend(), pool0, table, rows, out_slots, prefix_lens, extend_lens, qkv, masks, mode)
    got, got_pool = _run(TritonBackend(DEV, splits), pool0, table, rows, out_slots, prefix_lens, extend_lens,
                         qkv, masks, mode)
    assert got.shape == (total, heads * dim) and got.dtype == dtype
    torch.testing.assert_close(got, ref, **_tol(dtype))
    for a, b in zip(got_pool.k + got_pool.v, ref_pool.k + ref_pool.v):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim,splits", [(4, 2, 16, None), (4, 2, 32, 3), (4, 4, 64, 1),
                                                      (8, 2, 16, 16), (6, 2, 64, 16)])
def test_decode_ragged_lengths(heads, kv_heads, dim, splits, dtype):
    # seq lens 1, 71, 141 (three key blocks), 10; 16 splits leave most splits empty; the
    # last case merges the splits of 4 heads a program (reduce_splits), the last block half full
    _check([0, 70, 140, 9], [1, 1, 1, 1], heads, kv_heads, dim, dtype, mode=ForwardMode.DECODE, splits=splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (4, 4, 32), (4, 2, 64), (2, 1, 24)])
def test_extend_ragged_with_and_without_prefix(heads, kv_heads, dim, dtype):
    # 130 new tokens span three query blocks (and, times the GQA group, outgrow the short
    # kernel where the group is 2: the extend kernel); prefixes 0 and > one key block
    _check([0, 37, 0, 80], [5, 20, 130, 1], heads, kv_heads, dim, dtype)


def test_prefill_without_prefix():
    _check([0, 0], [33, 9], 4, 2, 32, mode=ForwardMode.DRAFT_EXTEND, seed=1)


def _random_tree_mask(n: int, g: torch.Generator) -> torch.Tensor:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    return Drafts.from_lists([[0] * n], [parents]).tree_mask()[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (4, 4, 32)])
def test_verify_tree_masks(heads, kv_heads, dim, dtype):
    drafts = Drafts.from_lists([[1, 2, 3, 4, 5, 6], [1, 2, 3], [7]],
                               [[-1, 0, 0, 1, 3, 2], [-1, 0, 0], [-1]])
    sizes = [6, 3, 1]
    masks = [m[:n, :n] for m, n in zip(drafts.tree_mask(), sizes)]
    g = torch.Generator().manual_seed(3)
    masks.append(_random_tree_mask(70, g))  # spans two 64-row query blocks
    masks = [m.to(DEV) for m in masks]
    _check([12, 70, 0, 5], sizes + [70], heads, kv_heads, dim, dtype, masks=masks, mode=ForwardMode.VERIFY)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim,splits", [(4, 2, 16, None), (6, 2, 32, 3), (4, 4, 64, 16),
                                                      (8, 2, 16, 2)])
def test_short_verify_split_over_keys(heads, kv_heads, dim, splits, dtype):
    """Trees of up to 64 nodes take the short-extend kernel (new tokens x query heads of a
    kv head in blocks of 64 rows, keys split): ragged trees (the largest over two or three
    row blocks), prefixes of 0, < and > a key block."""
    from specserve.attention.triton_verify import fits, row_blocks
    drafts = Drafts.from_lists([[1, 2, 3, 4, 5, 6], [1, 2, 3], [7]], [[-1, 0, 0, 1, 3, 2], [-1, 0, 0], [-1]])
    sizes = [6, 3, 1]
    masks = [m[:n, :n] for m, n in zip(drafts.tree_mask(), sizes)]
    masks.append(_random_tree_mask(40 if heads > kv_heads else 70, torch.Generator().manual_seed(4)))
    sizes.append(masks[-1].shape[0])
    assert fits(max(sizes), heads // kv_heads) and row_blocks(max(sizes), heads // kv_heads)[1] > 1
    _check([12, 150, 0, 64], sizes, heads, kv_heads, dim, dtype, masks=[m.to(DEV) for m in masks],
           mode=ForwardMode.VERIFY, splits=splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 4])
def test_short_causal_extend(dtype, splits):
    """Causal extends of a few tokens per request on the short-extend kernel, one of them
    over two row blocks (the first stops at its last token's key)."""
    _check([0, 37, 130, 5], [6, 40, 1, 3], 4, 2, 32, dtype, mode=ForwardMode.DRAFT_EXTEND, splits=splits, seed=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_with_draft_tail_equals_copied_rows(dtype, splits):
    """Tree drafting reads a request's prefix through its own row and the branch's draft
    ancestors from a tail: the same as a scratch row holding prefix ++ tail, on both
    backends, with ragged prefixes (shorter, equal to and longer than a key block)."""
    heads, kv_heads, dim, depth = 4, 2, 32, 3
    g = torch.Generator().manual_seed(5)
    prefixes = [90, 7, 64, 90]
    table, _, _ = _layout(prefixes, [0] * 4, g)
    rows = torch.tensor([0, 1, 2, 0], device=DEV)  # rows 0 and 3 are two branches of one request
    tail = (torch.randperm(NUM_SLOTS - 300, generator=g)[:4 * depth] + 301).view(4, depth).to(DEV)
    copied = table.clone()
    for i, (row, p) in enumerate(zip(rows.tolist(), prefixes)):  # scratch rows 4..7 = row ++ tail
        copied[4 + i, :p] = table[row, :p]
        copied[4 + i, p:p + depth] = tail[i]
    pool0 = KVPool(NUM_SLOTS, 2, kv_heads, dim, dtype, DEV)
    for t in pool0.k + pool0.v:
        t.copy_(torch.randn(t.shape, generator=g))
    qkv = [torch.randn(4, h, dim, generator=g).to(DEV, dtype) for h in (heads, kv_heads, kv_heads)]
    out_slots = tail[:, -1]
    want, _ = _run(TorchRefBackend(), pool0, copied, torch.arange(4, 8, device=DEV), out_slots,
                   [p + depth - 1 for p in prefixes], [1] * 4, qkv, mode=ForwardMode.DECODE)
    for backend in (TorchRefBackend(), TritonBackend(DEV, splits)):
        got, _ = _run(backend, pool0, table, rows, out_slots, prefixes, [1] * 4, qkv, mode=ForwardMode.DECODE,
                      tail=tail)
        torch.testing.assert_close(got, want, **_tol(dtype))


def test_cuda_graph_hooks_replay_equals_eager():
    """Capture metadata at bs 4 (3 real rows + 1 padding row), replay twice with new lengths."""
    heads, kv_heads, dim, bs = 4, 2, 16, 4
    g = torch.Generator().manual_seed(7)
    pool = KVPool(NUM_SLOTS, 2, kv_heads, dim, torch.float32, DEV)
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape, generator=g))
    backend = TritonBackend(DEV)
    backend.init_cuda_graph_state(8, 1)
    rows_s, slots_s = torch.zeros(8, dtype=torch.int64, device=DEV), torch.zeros(8, dtype=torch.int64, device=DEV)
    q_s, k_s, v_s = (torch.zeros(bs, h, dim, device=DEV) for h in (heads, kv_heads, kv_heads))
    table = torch.zeros(MAX_REQS, MAX_CONTEXT, dtype=torch.int64, device=DEV)

    def static_batch(prefix_lens):
        ids = torch.zeros(bs, dtype=torch.int64, device=DEV)
        return ForwardBatch(ForwardMode.DECODE, ids, ids, slots_s[:bs], rows_s[:bs], prefix_lens, [1] * bs,
                            table, pool, backend)

    captured = static_batch([0] * bs)
    backend.init_metadata_for_capture(captured)
    run = lambda: backend.forward(q_s, k_s, v_s, LAYER, captured, dim ** -0.5)  # noqa: E731
    if DEV.type == "cuda":
        run()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_s = run()
    for step, prefix_lens in enumerate(([30, 0, 100], [31, 140, 5])):
        tab, rows, out_slots = _layout(prefix_lens, [1, 1, 1], torch.Generator().manual_seed(step))
        table.copy_(tab)
        qkv = [torch.randn(3, h, dim, generator=g).to(DEV) for h in (heads, kv_heads, kv_heads)]
        ref, ref_pool = _run(TritonBackend(DEV), pool, table, rows, out_slots, prefix_lens, [1] * 3, qkv,
                             mode=ForwardMode.DECODE)
        for static, x in zip((q_s, k_s, v_s), qkv):
            static[:3].copy_(x)
            static[3:].zero_()
        rows_s[:3], rows_s[3] = rows, rows[0]  # padding: first real row, seq_len 1, slot 0
        slots_s[:3], slots_s[3] = out_slots, 0
        backend.init_metadata_for_replay(static_batch(prefix_lens + [0]))
        if DEV.type == "cuda":
            graph.replay()
        else:
            out_s = run()  # the captured batch's metadata object sees the new lengths in place
        torch.testing.assert_close(out_s[:3], ref, rtol=1e-5, atol=2e-5)
        assert torch.equal(pool.k[LAYER][out_slots], ref_pool.k[LAYER][out_slots])


def test_tiny_model_logits_match_reference(tmp_path):
    path = save_tiny_hf("llama", tmp_path / "m")
    with torch.device(DEV):  # BareRunner builds its batch tensors on the default device
        _tiny_model_logits_match_reference(load_model(path, torch.float32, DEV))


def _tiny_model_logits_match_reference(model) -> None:
    runners = [BareRunner(model), BareRunner(model)]
    runners[1].backend = TritonBackend(DEV)
    seqs = [list(range(3, 20)), list(range(40, 49))]
    tree = Drafts.from_lists([[5, 6, 7, 8, 9]], [[-1, 0, 0, 1, 3]])
    depth = tree.depths()[0].tolist()
    logits = []
    for r in runners:
        extend = r.forward([0, 1], [0, 0], seqs)
        decode = r.forward([0, 1], [len(s) for s in seqs], [[1], [2]], mode=ForwardMode.DECODE)
        p = len(seqs[0]) + 1
        verify = r.forward([0], [p], [tree.tokens[0].tolist()], positions=[[p + d for d in depth]],
                           masks=[tree.tree_mask()[0]], mode=ForwardMode.VERIFY)
        logits.append((extend, decode, verify))
    for got, ref in zip(logits[1], logits[0]):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_verify_graph_hooks_replay_equals_eager():
    """VERIFY graph state: N nodes per request, masks rewritten per replay, a padding request."""
    heads, kv_heads, dim, n, bs = 4, 2, 16, 4, 3
    g = torch.Generator().manual_seed(9)
    pool = KVPool(NUM_SLOTS, 2, kv_heads, dim, torch.float32, DEV)
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape, generator=g))
    backend = TritonBackend(DEV)
    backend.init_cuda_graph_state(4, n)
    drafts = Drafts.from_lists([[1, 2, 3, 4], [5, 6]], [[-1, 0, 0, 1], [-1, 0]]).padded(n)
    masks = [m.to(DEV) for m in drafts.tree_mask()]
    prefix_lens = [20, 75]
    table, rows, out_slots = _layout(prefix_lens, [n, n], g)
    qkv = [torch.randn(2 * n, h, dim, generator=g).to(DEV) for h in (heads, kv_heads, kv_heads)]
    ref, _ = _run(TritonBackend(DEV), pool, table, rows, out_slots, prefix_lens, [n, n], qkv, masks,
                  mode=ForwardMode.VERIFY)
    static_rows = torch.cat([rows, rows[:1]])  # the padding request reads through the first real row
    ids = torch.zeros(bs * n, dtype=torch.int64, device=DEV)
    fb = ForwardBatch(ForwardMode.VERIFY, ids, ids, torch.cat([out_slots, ids[:n]]), static_rows,
                      prefix_lens + [0], [n] * bs, table, pool, backend,
                      custom_masks=masks + [torch.ones(n, n, dtype=torch.bool, device=DEV)])
    backend.init_metadata_for_capture(fb)
    q, k, v = (torch.cat([x, x.new_zeros(n, *x.shape[1:])]) for x in qkv)
    out = backend.forward(q, k, v, LAYER, fb, dim ** -0.5)
    torch.testing.assert_close(out[:2 * n], ref, rtol=1e-5, atol=2e-5)


def test_prefill_graph_equals_eager_forward(tmp_path):
    """One request's prefill through its bucket's graph (runner/prefill_graphs.py; on a CPU
    the same body runs eagerly, interpreted) against the eager forward: a 20-token chunk
    padded to 32 rows, then 5 more over the cached 20 padded to 16. The last row's logits,
    every row's features and K/V agree; padding rows wrote nothing but the scratch slot 0."""
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
        graphs = PrefillGraphs(model, graphed.backend, 512, 32, template, "aux", capture=DEV.type == "cuda")
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
    for layer in range(model.config.num_layers):  # slot 0 is scratch: padding K/V land there
        for a, b in ((graphed.pool.k[layer], eager.pool.k[layer]), (graphed.pool.v[layer], eager.pool.v[layer])):
            torch.testing.assert_close(a[1:], b[1:], rtol=1e-4, atol=1e-4)


def test_batched_prefill_graph_equals_eager_forward(tmp_path):
    """Several requests' prefill chunks through graphs of up to 20 requests: first three
    fresh prompts (the middle one a chunk that samples nothing) in 32 rows, then a pair
    over their cached prefixes in 16 rows (18 padding requests, more than the rows),
    against eager forwards. Logits of the sampled rows, every row's features and K/V
    agree; padding wrote only the scratch slot 0. A 21st request or a prompt's every-row
    logits (prompt logprobs) are not the graph's."""
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
                               max_reqs=20)
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
    for layer in range(model.config.num_layers):  # slot 0 is scratch: padding K/V land there
        for a, b in ((graphed.pool.k[layer], eager.pool.k[layer]), (graphed.pool.v[layer], eager.pool.v[layer])):
            torch.testing.assert_close(a[1:], b[1:], rtol=1e-4, atol=1e-4)
    too_many = _prefill_many(graphed, [(r % 8, 0, [1], True) for r in range(21)])
    assert not graphs.can_run(too_many)
    every_row = _prefill_many(graphed, [(1, 0, tok(6, 6), True)])
    every_row.logit_rows = torch.arange(6, device=DEV)
    assert not graphs.can_run(every_row)


def test_draft_prefill_graph_equals_eager_extend(tmp_path):
    """EAGLE-3's draft extend over a prefill chunk through its bucket's graph
    (spec/draft_prefill_graphs.py; on a CPU the body runs eagerly, interpreted) against the
    eager draft extend: a middle chunk of 20 tokens padded to 32 (its root state goes to the
    scratch row), then the final 5 over the cached 20 padded to 16. The root state (top-k
    log-probabilities, ids, next hidden) and the draft's K/V agree; padding wrote only slot 0."""
    from specserve.models.draft_layouts import save_eagle3
    from specserve.models.draft_loader import load_draft
    from specserve.spec.draft_prefill_graphs import DraftPrefillGraphs
    from specserve.spec.root_states import RootStates
    from specserve.spec.tree_draft import top_children

    path = save_tiny_hf("llama", tmp_path / "m")
    target = load_model(path, torch.float32, DEV)
    draft = load_draft(save_eagle3(tmp_path / "e3", path, draft_vocab=96, aux_ids=[-1, 0, 1]), target, "EAGLE3", torch.float32, DEV)
    eager, graphed = BareRunner(draft), BareRunner(draft)
    graphed.backend = TritonBackend(DEV)
    hidden = draft.config.hidden_size
    roots = RootStates(MAX_REQS, 3, hidden, torch.float32, DEV)
    with torch.inference_mode():
        graphs = DraftPrefillGraphs(draft, graphed.backend, graphed.pool, graphed.table.table, 32, 3 * hidden, 3,
                                    draft.token_map, roots, capture=DEV.type == "cuda")
    assert graphs.sizes == [16, 32] and graphs.can_run(32) and not graphs.can_run(33)
    g = torch.Generator().manual_seed(0)
    tokens = [(7 * i + 3) % 512 for i in range(25)]
    features = torch.randn(25, 3 * hidden, generator=g).to(DEV)
    for prefix, n, final in ((0, 20, False), (20, 5, True)):
        chunk, feats = tokens[prefix:prefix + n], features[prefix:prefix + n]
        with torch.inference_mode():
            fb = _draft_extend_batch(eager, prefix, chunk)
            h_logits, h_next = draft(fb, feats)
            want = (*top_children(draft.compute_logits(h_logits[-1:]), 3, draft.token_map), h_next[-1:])
            slots = graphed.slots(n)
            graphed.table.write(0, prefix, slots)
            graphs.run([(chunk, prefix, 0, 0 if final else None)], slots, feats)
        row = 0 if final else roots.scratch_row
        got = roots.logp[row:row + 1], roots.ids[row:row + 1], roots.hidden[row:row + 1]
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-4)
        if not final:  # a middle chunk leaves the request's row alone
            assert not roots.hidden[0].any()
    for a, b in ((graphed.pool.k[0], eager.pool.k[0]), (graphed.pool.v[0], eager.pool.v[0])):
        torch.testing.assert_close(a[1:], b[1:], rtol=1e-4, atol=1e-4)


def test_batched_draft_prefill_graph_equals_eager_extend(tmp_path):
    """One draft prefill graph over three requests' chunks (7 + 5 + 3 tokens padded to 16,
    three requests to four): each final chunk's root state and every request's draft K/V
    are those of its own eager draft extend; the middle chunk's request (row 1) keeps no
    state, and the padding request writes only the scratch row and slot 0."""
    from specserve.models.draft_layouts import save_eagle3
    from specserve.models.draft_loader import load_draft
    from specserve.spec.draft_prefill_graphs import DraftPrefillGraphs
    from specserve.spec.root_states import RootStates
    from specserve.spec.tree_draft import top_children

    path = save_tiny_hf("llama", tmp_path / "m")
    target = load_model(path, torch.float32, DEV)
    draft = load_draft(save_eagle3(tmp_path / "e3", path, draft_vocab=96, aux_ids=[-1, 0, 1]), target, "EAGLE3", torch.float32, DEV)
    eager, graphed = BareRunner(draft), BareRunner(draft)
    graphed.backend = TritonBackend(DEV)
    hidden = draft.config.hidden_size
    roots = RootStates(MAX_REQS, 3, hidden, torch.float32, DEV)
    with torch.inference_mode():
        graphs = DraftPrefillGraphs(draft, graphed.backend, graphed.pool, graphed.table.table, 16, 3 * hidden, 3,
                                    draft.token_map, roots, capture=DEV.type == "cuda", max_reqs=4)
    assert graphs.keys == [(16, 1), (16, 4)] and graphs.can_run(16, 4) and not graphs.can_run(16, 5)
    g = torch.Generator().manual_seed(1)
    reqs = [(0, [(5 * i + 2) % 512 for i in range(7)], True), (1, [(3 * i + 1) % 512 for i in range(5)], False),
            (2, [(11 * i + 4) % 512 for i in range(3)], True)]
    features = torch.randn(15, 3 * hidden, generator=g).to(DEV)
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
    for row, (logp, ids, h) in want.items():
        torch.testing.assert_close(roots.logp[row:row + 1], logp, rtol=1e-4, atol=1e-4)
        assert torch.equal(roots.ids[row:row + 1], ids)
        torch.testing.assert_close(roots.hidden[row:row + 1], h, rtol=1e-4, atol=1e-4)
    assert not roots.hidden[1].any() and not roots.hidden[3].any()  # a middle chunk; no request
    for a, b in ((graphed.pool.k[0], eager.pool.k[0]), (graphed.pool.v[0], eager.pool.v[0])):
        torch.testing.assert_close(a[1:], b[1:], rtol=1e-4, atol=1e-4)


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
