"""Sampler: distribution, filters, seeds and logprobs (penalties: test_logits_process.py)."""
from __future__ import annotations

import torch
from scipy.stats import chisquare

from specserve.runner.sampler import SamplingBatch, filter_logits, sample, uniform_noise


def _sb(b: int, **kw) -> SamplingBatch:
    def full(v, dtype=torch.float32):
        return torch.full((b,), v, dtype=dtype)

    args = dict(temperature=full(1.0), greedy=full(False, torch.bool), top_p=full(1.0),
                top_k=full(1000, torch.int64), min_p=full(0.0), seeds=torch.arange(b, dtype=torch.int64) * 7919 + 1,
                counters=torch.zeros(b, dtype=torch.int64))
    args.update(kw)
    return SamplingBatch(**args)


def test_samples_follow_softmax_with_temperature():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 20000
    sb = _sb(n, temperature=torch.full((n,), 0.7))
    ids = sample(logits.expand(n, -1).clone(), sb).next_ids
    observed = torch.bincount(ids, minlength=5).double()
    expected = (logits / 0.7).softmax(-1).double() * n
    assert chisquare(observed, expected).pvalue > 1e-4


def test_top_k_top_p_min_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    sb = _sb(3, top_k=torch.tensor([2, 4, 4]), top_p=torch.tensor([1.0, 0.8, 1.0]),
             min_p=torch.tensor([0.0, 0.0, 0.35]))
    kept = torch.isfinite(filter_logits(logits, sb))
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False],
                             [True, True, False, False]]


def test_greedy_rows_take_argmax_and_noise_is_finite():
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, -1.0]])
    assert sample(logits, _sb(2, greedy=torch.tensor([True, True]))).next_ids.tolist() == [1, 1]
    # the largest hash value must not round to u = 1 (+inf noise: NaN on a masked -inf logit)
    u = uniform_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096)
    assert float(u.max()) < 1.0 and float(u.min()) > 0.0


def test_same_seed_same_tokens_regardless_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    sb = _sb(4, seeds=torch.tensor([11, 22, 33, 44]), counters=torch.tensor([0, 5, 9, 2]))
    together = sample(logits, sb).next_ids
    alone = sample(logits[2:3], _sb(1, seeds=torch.tensor([33]), counters=torch.tensor([9]))).next_ids
    assert together[2] == alone[0]
    u = uniform_noise(torch.tensor([1, 2]), torch.tensor([0, 0]), 1000)
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.02
    assert not torch.equal(u[0], u[1])


def test_logprobs_are_model_log_softmax():
    logits = torch.randn(2, 50)
    sb = _sb(2, greedy=torch.tensor([True, True]), want_logprobs=True, top_logprobs=3)
    out = sample(logits, sb)
    ref = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, ref.max(-1).values)
    torch.testing.assert_close(out.top_logprobs, ref.topk(3).values)


def test_greedy_batches_share_their_tensors_and_take_the_argmax():
    """sampling_batch builds a greedy batch's (unread) tensors once per batch size; any
    request that samples, penalises or wants logprobs takes the general path."""
    from specserve.core.request import Req
    from specserve.core.sampling_params import SamplingParams
    from specserve.runner.sampler import sampling_batch

    def reqs(*params: SamplingParams) -> list[Req]:
        return [Req(f"r{i}", [1, 2], p, seed=i, detok=None, stops=None) for i, p in enumerate(params)]

    greedy = SamplingParams(temperature=0)
    a, b = sampling_batch(reqs(greedy, greedy), 100, torch.device("cpu")), \
        sampling_batch(reqs(greedy, greedy), 100, torch.device("cpu"))
    assert a.all_greedy and a.temperature is b.temperature
    logits = torch.randn(2, 100)
    assert torch.equal(sample(logits, a).next_ids, logits.argmax(-1))
    for other in (SamplingParams(temperature=0.7), SamplingParams(temperature=0, logprobs=True)):
        mixed = sampling_batch(reqs(greedy, other), 100, torch.device("cpu"))
        assert mixed.temperature is not a.temperature
