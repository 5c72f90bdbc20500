"""TritonBackend against the reference backend: decode, extend, verify, GQA, graph hooks, a model.

On CUDA the kernels run compiled (fp32 and bf16); on CPU under TRITON_INTERPRET=1, which
must be set before triton is first imported. Shapes stay small so the interpreter is quick.
Every check runs both backends on copies of one random KV pool and compares the outputs
and the pools after the forward (the new K/V at out_slots).
"""
from __future__ import annotations

import pytest
import torch

from specserve.attention.torch_ref import TorchRefBackend  # noqa: E402
from specserve.attention.triton_backend import TritonBackend  # noqa: E402
from specserve.cache.kv_pool import KVPool  # noqa: E402
from specserve.core.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402
from specserve.spec.drafts import Drafts  # noqa: E402
from tests.unit.model_utils import BareRunner, save_tiny_hf  # noqa: E402
from tests.unit.triton_interp import DEV  # first: sets TRITON_INTERPRET before triton is imported

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


def test_split_merge_ignores_what_empty_splits_left():
    # an empty split writes lse -inf and no o: the merge loads its o with the others' and
    # must drop it, whatever the memory held (NaN here)
    from specserve.attention.split_merge import reduce_splits
    g = torch.Generator().manual_seed(3)
    rows, heads, splits, dim = 3, 6, 16, 24
    mid = torch.randn(rows, heads, splits, dim, generator=g)
    lse = torch.randn(rows, heads, splits, generator=g) * 4
    live = torch.tensor([1, 5, 16])  # non-empty splits per row: the first ones
    for r, n in enumerate(live.tolist()):
        mid[r, :, n:] = float("nan")
        lse[r, :, n:] = float("-inf")
    w = torch.exp2(lse - lse.amax(-1, keepdim=True))
    ref = (w[..., None] * torch.nan_to_num(mid)).sum(2) / w.sum(-1, keepdim=True)
    out = torch.empty(rows, heads, dim, device=DEV)
    reduce_splits(mid.to(DEV), lse.to(DEV), out, splits)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)


def test_split_launches_merge_their_splits_in_the_last_to_finish(monkeypatch):
    """With splits, a decode or a short verify launch merges them itself (the last split of
    each group of rows to count in): no merge launch after it, the output that launch
    gives (rows with empty splits, NaN left where they write nothing), and every count
    back at 0 for the next launch."""
    from specserve.attention import split_merge
    from specserve.attention.triton_decode import decode_attention
    from specserve.attention.triton_verify import short_extend_attention

    g = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, splits = 6, 2, 24, 16
    pool = [torch.randn(400, kv_heads, dim, generator=g).to(DEV) for _ in range(2)]
    table = (torch.randperm(399, generator=g)[:3 * 120] + 1).view(3, 120).to(DEV)
    rows, i32 = torch.arange(3, device=DEV), dict(dtype=torch.int32, device=DEV)
    seq, prefix, extend = torch.tensor([1, 70, 120], **i32), torch.tensor([0, 60, 113], **i32), torch.tensor([1, 5, 7], **i32)
    q_dec = torch.randn(3, heads, dim, generator=g).to(DEV)
    q_ver = torch.randn(13, heads, dim, generator=g).to(DEV)
    launches = {
        "decode": (q_dec, lambda out: decode_attention(q_dec, *pool, out, table, rows, seq, dim ** -0.5, splits)),
        "verify": (q_ver, lambda out: short_extend_attention(q_ver, *pool, out, table, rows, prefix, extend,
                                                              torch.tensor([0, 1, 6], **i32), 7, dim ** -0.5, splits)),
    }
    for name, (q, launch) in launches.items():
        outs, merges = [], []
        for fused in (True, False):
            with monkeypatch.context() as m:
                m.setattr(split_merge, "FUSED_MERGE", fused)
                m.setattr(split_merge, "reduce_splits",
                          lambda *a, real=split_merge.reduce_splits, fused=fused: merges.append(fused) or real(*a))
                out = torch.full(q.shape, float("nan"), device=DEV)
                launch(out)
            outs.append(out)
        assert merges == [False], name  # a merge launch after the unfused launch only
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
        assert not split_merge.split_counts(DEV).any(), name


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
    kv head in blocks of 64 rows, 32 in float32, keys split): ragged trees (the largest over
    two or more row blocks), prefixes of 0, < and > a key block."""
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
