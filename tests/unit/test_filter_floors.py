"""kernels/filters.py: each row's top-k / top-p / min-p floor without a sort, against the
sorting reference (runner.sampler.filter_floors) and against the filters' definitions, by
one program a row and spread over programs (filters_spread.py, the few-rows path).
Compiled on CUDA, under the interpreter on CPU."""
from __future__ import annotations

import math

import pytest  # noqa: E402
import torch

from tests.unit.fused_utils import DEV  # first: sets TRITON_INTERPRET on CPU

pytest.importorskip("triton")

from specserve import kernels  # noqa: E402
from specserve.kernels import filters, filters_spread  # noqa: E402
from specserve.runner.sampler import HostFlags, SamplingBatch, filter_floors  # noqa: E402

_PARAMS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 50, 1.0, 0.0), (0.7, 1, 1.0, 0.0), (1.3, 10**6, 0.9, 0.0), (1.0, 40, 0.95, 0.0),
    (0.5, 10**6, 1.0, 0.1), (2.0, 2000, 0.99, 0.01), (1.0, 10**6, 0.3, 0.0), (3.0, 700, 1.0, 0.0),
]


def _batch(params: list[tuple[float, int, float, float]], device: torch.device = DEV) -> SamplingBatch:
    t, k, p, mp = (list(c) for c in zip(*params))
    b = len(params)

    def f(v: list) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.float32, device=device)

    return SamplingBatch(temperature=f(t), greedy=torch.zeros(b, dtype=torch.bool, device=device), top_p=f(p),
                         top_k=torch.tensor(k, dtype=torch.int64, device=device), min_p=f(mp),
                         seeds=torch.arange(b, device=device), counters=torch.zeros(b, dtype=torch.int64, device=device),
                         flags=HostFlags(all_greedy=False, needs_sort=True, needs_min_p=True))


def _both(logits: torch.Tensor, sb: SamplingBatch, per_request: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    with kernels.fused_kernels(True):
        got = filter_floors(logits, sb, per_request)
    with kernels.fused_kernels(False):
        ref = filter_floors(logits.cpu(), _batch_on(sb, torch.device("cpu")), per_request)
    return got.cpu(), ref


def _batch_on(sb: SamplingBatch, device: torch.device) -> SamplingBatch:
    import dataclasses
    return dataclasses.replace(sb, **{f.name: getattr(sb, f.name).to(device) for f in dataclasses.fields(sb)
                                      if isinstance(getattr(sb, f.name), torch.Tensor)})


@pytest.fixture(params=["spread", "one program a row"])
def path(request, monkeypatch):
    """Each test that takes it runs on both paths, whatever its number of rows."""
    monkeypatch.setattr(filters, "SPREAD_ROWS", 10**9 if request.param == "spread" else 0)
    return request.param


def _kept_by_definition(row: torch.Tensor, t: float, k: int, p: float, min_p: float) -> torch.Tensor:
    """Token v is kept iff fewer than k logits exceed it, the softmax mass (at t) of those
    that exceed it is below p, and its probability is at least min_p times the largest."""
    x = row.double()
    e = torch.exp((x - x.max()) / t)
    above = x[None, :] > x[:, None]  # [v, u]: u exceeds v
    count = above.sum(-1)
    mass = (above * e[None, :]).sum(-1) / e.sum()
    keep = (count < k) & ((mass < p) | (p >= 1.0))
    return keep & (e >= min_p) if min_p > 0 else keep


@pytest.mark.parametrize("vocab", [100, 5000])
def test_floors_equal_the_sorting_reference(vocab, path):
    """Rows of normal logits at several scales; with 5000 logits the bracket is bisected
    before the sort, with 100 it is sorted at once."""
    g = torch.Generator().manual_seed(vocab)
    rows = len(_PARAMS)
    logits = torch.randn(rows, vocab, generator=g) * torch.tensor([1.0, 3.0, 0.5, 2.0, 1.0, 4.0, 1.5, 1.0])[:, None]
    got, ref = _both(logits.to(DEV), _batch(_PARAMS))
    assert torch.equal(got, ref), (got, ref)


def test_the_kept_set_is_the_definition(path):
    """On small rows with ties (integer logits) and masked tokens, {l >= floor} is exactly
    the definition's kept set, on both paths: ties at the edge of top-k stay."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randint(-4, 4, (len(_PARAMS), 60), generator=g).float()
    logits[:, :5] = float("-inf")  # a grammar's mask
    logits[:, 7] += 0.25
    sb = _batch([(t, min(k, 9), p, mp) for t, k, p, mp in _PARAMS])
    got, ref = _both(logits.to(DEV), sb)
    for r, (t, k, p, mp) in enumerate(_PARAMS):
        want = _kept_by_definition(logits[r], t, min(k, 9), p, mp)
        assert torch.equal(logits[r] >= ref[r], want), r
        assert torch.equal(logits[r] >= got[r], want), r


@pytest.mark.parametrize("cap,value_passes", [(16, 12), (16, 2), (8, 0)])
def test_a_narrow_bracket_is_bisected_to_the_same_floor(cap, value_passes, path, monkeypatch):
    """With a small CAP the bracket is bisected many times, by value and then by the
    float's bits (after the spread path's rounds); a tie group larger than CAP ends at
    adjacent floats (the floor is its value)."""
    monkeypatch.setattr(filters, "CAP", cap)
    monkeypatch.setattr(filters_spread, "CAP", cap)
    monkeypatch.setattr(filters, "VALUE_PASSES", value_passes)
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 3000, generator=g) * 2
    logits[2, :40] = 9.5  # 40 tied tokens at the top, cut by top-k 20
    logits[3, 100:600] = 1e-30  # a dense cluster near zero
    params = [(1.0, 30, 1.0, 0.0), (1.0, 10**6, 0.8, 0.0), (1.0, 20, 1.0, 0.0), (1.0, 10**6, 0.999, 0.0)]
    got, ref = _both(logits.to(DEV), _batch(params))
    assert torch.equal(got, ref), (got, ref)
    assert got[2] == 9.5 and (logits[2] >= got[2]).sum() == 40


def test_rows_share_their_request_params_and_unfiltered_rows_keep_all(path):
    """per_request rows take one request's params (a verify's nodes); a row with neither
    top-k, top-p nor min-p gets -inf, as does a top-k over every finite token."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 2500, generator=g)
    params = [(1.0, 10**6, 1.0, 0.0), (0.9, 5, 0.5, 0.0), (1.0, 2500, 1.0, 0.0)]
    got, ref = _both(logits.to(DEV), _batch(params), per_request=2)
    assert torch.equal(got, ref)
    assert got[[0, 1, 4, 5]].eq(float("-inf")).all() and torch.isfinite(got[2:4]).all()


def test_min_p_floor_is_its_logit_threshold(path):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    got, ref = _both(logits.to(DEV), _batch([(1.0, 10**6, 1.0, 0.35)]))
    assert math.isclose(ref.item(), logits[0, 0].item() + math.log(0.35), rel_tol=1e-6)
    assert (logits[0] >= got[0]).tolist() == [True, True, False, False]


def _shaped_rows(vocab: int) -> torch.Tensor:
    """Rows that the rounds' cuts split badly: a heavy upper tail, one far outlier below,
    integer ties, all equal (no deviation), mostly masked, and a plain bell."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    x[0, ::97] += 12.0
    x[1, 3] = -1e4
    x[2] = (x[2] * 2).round()
    x[3] = 0.5
    x[4, : vocab - 300] = float("-inf")
    return x


@pytest.mark.parametrize("rounds,cuts,slot", [(1, 4, 2), (2, 8, 4), (3, 16, 64)])
def test_rounds_cuts_and_slots_reach_the_same_floor(rounds, cuts, slot, monkeypatch):
    """However many rounds and cuts narrow the spread path's bracket, and whether the
    chunks' kept logits hold it (else the last program gathers from the row, or bisects
    past CAP), on rows the cuts split badly, the floors are the reference's."""
    monkeypatch.setattr(filters, "SPREAD_ROWS", 10**9)
    for name, v in (("ROUNDS", rounds), ("CUTS", cuts), ("SLOT", slot)):
        monkeypatch.setattr(filters_spread, name, v)
    params = [(1.0, 50, 0.9, 0.0), (1.0, 10**6, 0.95, 0.0), (1.0, 20, 1.0, 0.0), (0.7, 10**6, 0.5, 0.05),
              (1.0, 100, 1.0, 0.0), (1.3, 300, 0.99, 0.0)]
    logits = _shaped_rows(3000)
    got, ref = _both(logits.to(DEV), _batch(params))
    assert torch.equal(got, ref), (got, ref)
