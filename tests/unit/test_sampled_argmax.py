"""kernels/argmax.py: seeded sampling's Gumbel-max draw in one pass over the logits, for
plain sampling (runner.sampler.sample) and a sampled verify's walk (spec.accept.walk_greedy),
against the torch path it replaces. Compiled on CUDA, under the interpreter on CPU.

The reference draws its noise through the same noise kernel (kernels.gumbel_noise), so
the draws must be equal, not close: plain and speculative sampling stay token-identical
under a seed only if the fused draw is the torch path's exactly.
"""
from __future__ import annotations

import pytest  # noqa: E402
import torch

from tests.unit.fused_utils import DEV  # first: sets TRITON_INTERPRET on CPU

pytest.importorskip("triton")

from specserve import kernels  # noqa: E402
from specserve.kernels import argmax  # noqa: E402
from specserve.runner.sampler import HostFlags, SamplingBatch, filter_floors, sample  # noqa: E402
from specserve.spec.accept import gumbel_targets, walk_greedy  # noqa: E402
from tests.unit.test_tree_kernels import _random_trees  # noqa: E402


def _params(rows: int, seed: int) -> dict:
    """Temperatures from near-greedy to hot, greedy rows mixed in, seeds using their high bits."""
    g = torch.Generator().manual_seed(seed)
    temperature = torch.tensor([1.0, 0.7, 0.0, 2.0, 1e-7, 1.3])[torch.arange(rows) % 6]
    greedy = temperature == 0
    seeds = torch.randint(0, 2**62, (rows,), generator=g) | (torch.arange(rows) % 2 << 40)
    return {"temperature": temperature.to(DEV), "greedy": greedy.to(DEV), "seeds": seeds.to(DEV)}


def _torch_draw(logits: torch.Tensor, p: dict, counters: torch.Tensor, per_request: int = 1) -> torch.Tensor:
    """runner.sampler.sample's temperature-only draw in torch ops, the noise from the kernel."""
    rep = {k: v.repeat_interleave(per_request) for k, v in p.items()}
    with kernels.fused_kernels(True):
        noise = kernels.gumbel_noise(rep["seeds"], counters, logits.shape[-1])
    scaled = logits / torch.where(rep["greedy"], 1.0, rep["temperature"]).clamp_min(1e-5)[:, None]
    return torch.where(rep["greedy"], logits.argmax(-1), (scaled + noise).argmax(-1))


@pytest.mark.parametrize("rows,vocab,chunk", [(6, 1000, 4096), (6, 1000, 64), (3, 4096 + 17, 4096), (1, 77, 32)])
def test_the_fused_draw_is_the_torch_draw(rows, vocab, chunk, monkeypatch):
    """Equal draws for every row, chunks reduced across programs (64-logit chunks: 16 of
    them), including greedy rows, a near-zero temperature and ties (first index wins)."""
    monkeypatch.setattr(argmax, "CHUNK", chunk)
    for seed in range(3):
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)).to(DEV)
        logits[:, vocab // 2] = logits[:, vocab // 3] = logits.max() + 1  # a tie at the top
        p = _params(rows, seed)
        counters = torch.arange(rows, device=DEV) * 5 + seed
        with kernels.fused_kernels(True):
            got = kernels.sampled_argmax(logits, kernels.Tempered(counters=counters, **p))
        assert torch.equal(got, _torch_draw(logits, p, counters)), seed
        greedy = p["greedy"]
        assert torch.equal(got[greedy], torch.full_like(got[greedy], vocab // 3))  # the first of the tie
    # flat logits at T=1: the draw is uniform over 8 tokens and moves with the counter
    flat = kernels.Tempered(counters=torch.arange(64, device=DEV), per_request=64, **_params(1, 0))
    with kernels.fused_kernels(True):
        draws = kernels.sampled_argmax(torch.zeros(64, 8, device=DEV), flat)
    assert len(set(draws.tolist())) >= 6


def _batch(p: dict, counters: torch.Tensor, top_k: int = 10**6, top_p: float = 1.0,
           min_p: float = 0.0) -> SamplingBatch:
    """A temperature-only SamplingBatch of `p`, or one limiting every request by the filters."""
    rows = p["seeds"].numel()
    top_k_t = torch.full((rows,), top_k, device=DEV)
    return SamplingBatch(top_p=torch.full((rows,), top_p, device=DEV), top_k=top_k_t,
                         min_p=torch.full((rows,), min_p, device=DEV), counters=counters,
                         flags=HostFlags(all_greedy=False, needs_sort=top_k < 10**6 or top_p < 1.0,
                                         needs_min_p=min_p > 0), **p)


def test_sample_takes_the_fused_draw_with_and_without_filters(monkeypatch):
    """Plain sampling on the fused side of the switch is the kernel's draw: for a
    temperature-only batch the torch draw's tokens; with top-k 5 the torch draw over the
    logits above each row's floor (kernels/filters.py), which keeps each row's top 5."""
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(4)).to(DEV)
    p, counters = _params(6, 4), torch.arange(6, device=DEV) + 100
    with kernels.fused_kernels(True):
        got = sample(logits, _batch(p, counters)).next_ids
    assert torch.equal(got, _torch_draw(logits, p, counters))

    limited_batch = _batch(p, counters, top_k=5)
    with kernels.fused_kernels(True):
        limited = sample(logits, limited_batch).next_ids
        floors = filter_floors(logits, limited_batch)
    masked = logits.masked_fill(logits < floors[:, None], float("-inf"))
    assert torch.equal(limited, _torch_draw(masked, p, counters))
    top5 = logits.argsort(-1, descending=True)[:, :5]
    assert ((top5 == limited[:, None]).any(-1)).all()
    assert torch.equal((logits >= floors[:, None]).sum(-1), torch.full((6,), 5, device=DEV))


@pytest.mark.parametrize("n", [1, 6, 33])
def test_a_sampled_walk_forms_its_targets_in_the_kernel(n):
    """walk_greedy with `sampled` (the step graphs' call) walks the same targets as the
    walk over gumbel_targets' tensor: the same packed rows (paths, tokens, bonus), greedy
    and sampled requests mixed, each node keyed by its request's output index + depth,
    with no filter, top-k, top-p and min-p (each node's floor under its request's params)."""
    for seed in range(4):
        drafts, logits = _random_trees(5, n, 3 if seed % 2 else 6, seed)
        p = _params(5, seed)
        # filters on the smaller trees (the interpreter runs the floors' sort slowly)
        filters = [{}, {"top_k": 3}, {"top_p": 0.6}, {"min_p": 0.2, "top_k": 50}][seed] if n < 33 else {}
        sb = _batch(p, torch.tensor([0, 3, 9, 1, 40], device=DEV) + seed, **filters)
        with kernels.fused_kernels(True):
            got, _ = walk_greedy(drafts, logits, None, sb)
            ref, _ = walk_greedy(drafts, gumbel_targets(logits, sb, drafts.depths()), None)
        assert torch.equal(got, ref), seed
