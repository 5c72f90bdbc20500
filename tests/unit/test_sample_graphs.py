"""runner/sample_graphs.py: a decode step's seeded sampling replayed from static buffers
draws the tokens eager sampling draws (runner.sampler.sample over sampling_batch), for
greedy, tempered and filtered requests mixed, padded up to a captured size, with the
overlap's lag in the output index, whether the step rewrites the static buffers or finds
them already holding its requests. Eager body on a CPU; captured graphs on CUDA."""
from __future__ import annotations

import pytest
import torch

from specserve.offline import make_sampling_params
from specserve.runner.sample_graphs import SampleGraphs
from specserve.runner.sampler import sample, sampling_batch

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PARAMS = [{"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9, "top_k": 50},
          {"temperature": 1.3, "min_p": 0.05}, {"temperature": 1.0, "top_k": 3}, {"temperature": 0.5, "top_p": 0.5}]


class _Req:
    def __init__(self, i: int, params: dict, produced: int | None = None) -> None:
        self.params = make_sampling_params({"max_new_tokens": 100, **params})
        self.output_ids, self.seed = [0] * (3 * i if produced is None else produced), 1000 + 17 * i


@pytest.mark.parametrize("b", [1, 3, 6])
def test_a_replay_draws_the_eager_tokens(b):
    logits = torch.zeros(8, 3000, device=DEV)
    graphs = SampleGraphs(logits, [1, 2, 4, 8], capture=DEV.type == "cuda")
    reqs = [_Req(i, PARAMS[(i + b) % len(PARAMS)]) for i in range(b)]
    lag = [i % 2 for i in range(b)]
    # each step's requests against the last's: the same (nothing written: the replay moved
    # the counters on), the same a token further (nothing written), two tokens further,
    # the same again, new objects with equal fields, one request fewer
    advance = [0, 1, 1, 2, 0, 1, 1]
    for step, n in enumerate(advance):
        for r in reqs:
            r.output_ids += [0] * n
        if step == 5:
            reqs = [_Req(i, PARAMS[(i + b) % len(PARAMS)], len(r.output_ids)) for i, r in enumerate(reqs)]
        if step == 6 and b > 1:
            reqs = reqs[:-1]
        logits.copy_(torch.randn(8, 3000, generator=torch.Generator().manual_seed(step)) * 3)
        assert graphs.covers(logits[:len(reqs)], sb_greedy=False, logprobs=False)
        got = graphs.sample(reqs, lag[:len(reqs)]).next_ids
        want = sample(logits[:len(reqs)].clone(), sampling_batch(reqs, 3000, DEV, lag[:len(reqs)])).next_ids
        assert torch.equal(got, want), (step, got, want)
    assert not graphs.covers(logits[:b].clone(), sb_greedy=False, logprobs=False)  # not the static rows
    assert not graphs.covers(logits[:b], sb_greedy=True, logprobs=False)
    assert not graphs.covers(logits[:b], sb_greedy=False, logprobs=True)
