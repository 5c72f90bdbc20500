"""EAGLE's draft-ahead kernel (kernels/ahead.py) against its torch reference.

Unit level: random greedy walks, requests padded to a captured batch size; the kernel's
table writes, extend inputs (padding included) and tree inputs equal the torch path's.
Engine level: the EAGLE engines of test_eagle_engine run with the kernel forced on (CPU,
TRITON_INTERPRET): the same tokens, and the same trees step for step, as without it.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from specserve.spec.accept import GreedyWalk, accept  # noqa: E402
from specserve.spec.drafts import Drafts  # noqa: E402
from specserve.spec.eagle import proposer as eagle_mod  # noqa: E402
from tests.unit.test_accept import _coins, _sb  # noqa: E402
from tests.unit.test_eagle_engine import tiny  # noqa: E402,F401  (the fixture)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _walk(b: int, n: int, seed: int, packed: bool = False) -> GreedyWalk:
    """A greedy walk over random trees (4-token vocabulary: paths of every length occur);
    `packed`: on_path and bonus as the fused walk hands them over, strided int64 views of
    its packed rows [B, 2N + 1]."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
                           for _ in range(b)])
    drafts = Drafts(torch.randint(0, 4, (b, n), generator=g), parents, torch.ones(b, n, dtype=torch.bool))
    seen = []
    accept(drafts, torch.randn(b, n, 4, generator=g), _sb(b, greedy=True), *_coins(b, n), before_read=seen.append)
    w = seen[0]
    if packed:
        rows = torch.cat([w.on_path.to(torch.int64), w.tokens, w.bonus[:, None]], dim=1).to(DEV)
        return GreedyWalk(rows[:, :n], w.tokens.to(DEV), rows[:, 2 * n])
    return GreedyWalk(w.on_path.to(DEV), w.tokens.to(DEV), w.bonus.contiguous().to(DEV))


def _reference(walk: GreedyWalk, slots, rows, starts, L, padded, scratch_row, table):
    """The torch path's values: table written in place; (index [7], roots, kv_lens)."""
    b, n = slots.shape
    p = walk.paths(L)
    col = torch.arange(L, device=DEV)
    committed = col < p.lens[:, None]
    pos = starts[:, None] + col
    kept = torch.where(committed, slots.gather(1, p.nodes), 0)
    cells = (rows[:, None].expand(b, L), pos)
    table[cells] = torch.where(committed, kept, table[cells])
    pad = padded - b
    z = torch.zeros(pad * L, dtype=torch.int64, device=DEV)
    index = [torch.cat([torch.where(committed, p.tokens, 0).reshape(-1), z]), torch.cat([pos.reshape(-1), z]),
             torch.cat([kept.reshape(-1), z]),
             torch.cat([(torch.arange(b, device=DEV)[:, None] * n + torch.where(committed, p.nodes, 0)).reshape(-1), z]),
             torch.cat([rows, rows[:1].expand(pad)]),
             torch.cat([torch.arange(b, device=DEV) * L + p.lens - 1, torch.arange(b, padded, device=DEV) * L]),
             torch.cat([rows, torch.full((pad,), scratch_row, device=DEV)])]
    return index, p.tokens.gather(1, (p.lens - 1)[:, None])[:, 0], starts + p.lens


@pytest.mark.parametrize("b,n,L,padded,packed", [(1, 8, 6, 1, True), (3, 6, 4, 4, False), (5, 16, 6, 8, True),
                                                 (2, 3, 6, 2, False)])
def test_kernel_equals_the_torch_path(b, n, L, padded, packed):
    from specserve.kernels.ahead import draft_ahead_index

    walk = _walk(b, n, seed=b * 100 + n, packed=packed)
    slots = torch.randperm(200)[:b * n].view(b, n).to(DEV) + 1
    rows = torch.randperm(8)[:b].to(DEV)
    starts = torch.randint(0, 20, (b,)).to(DEV)
    table = torch.randint(0, 1000, (8, 64), dtype=torch.int64).to(DEV)
    want_table = table.clone()
    want, want_roots, want_lens = _reference(walk, slots, rows, starts, L, padded, 99, want_table)
    static = [torch.full((padded * L + 3,), -7, dtype=torch.int64, device=DEV) for _ in range(4)] + \
             [torch.full((padded + 2,), -7, dtype=torch.int64, device=DEV) for _ in range(3)]
    prefix32 = torch.full((padded + 2,), -7, dtype=torch.int32, device=DEV)
    kv_out = starts.clone()  # written in place: the tensor row_start copied its starts from
    roots, kv_lens, tails = draft_ahead_index(walk.on_path, walk.tokens, walk.bonus, slots,
                                              torch.cat([rows, kv_out]), table, static, padded, L, 99,
                                              shift=1, kv_lens=kv_out, prefix32=prefix32)
    assert torch.equal(table, want_table)
    for got, ref in zip(static, want):
        assert torch.equal(got[:ref.numel()], ref)
        assert (got[ref.numel():] == -7).all()  # nothing past the padded batch
    assert torch.equal(roots, want_roots) and torch.equal(kv_lens, want_lens) and kv_lens is kv_out
    assert torch.equal(tails, want_lens)  # kv_len after + 1 - shift, shift 1
    want_prefix = torch.cat([starts, torch.zeros(padded - b, dtype=torch.int64, device=DEV)]).to(torch.int32)
    assert torch.equal(prefix32[:padded], want_prefix) and (prefix32[padded:] == -7).all()
    roots, kv_lens, tails = draft_ahead_index(walk.on_path, walk.tokens, walk.bonus, slots, torch.cat([rows, starts]),
                                              table, static, padded, L, 99)  # shift 0, fresh outputs
    assert torch.equal(kv_lens, want_lens) and torch.equal(tails, want_lens + 1)


@pytest.mark.parametrize("head", ["EAGLE", "EAGLE3"])
def test_engines_with_the_kernel_draft_the_same_trees(tiny, smollm2_dir, head, monkeypatch):
    from tests.unit import test_eagle_engine as t

    monkeypatch.setattr(eagle_mod, "_ahead_kernel_enabled", lambda x: True)
    t.test_trees_drafted_ahead_are_the_trees_drafted_after_the_read_back(tiny, smollm2_dir, head, monkeypatch)
