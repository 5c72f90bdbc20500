"""The speculation governor on a CPU, where a forward costs its tokens from batch 1 up.

On a GPU a verify of N tokens per request is almost free until the batch turns the GPU
compute-bound; on a CPU every token a forward carries costs time at any batch, so
speculation that pays at batch 1 can lose at batch 32 even with every draft accepted.
These tests run the real engine (worker, scheduler, governor, EAGLE-3 proposer) with the
default `--speculative-adaptive auto` on the CPU, and time its steps with a fake clock
that charges every target and draft forward a fixed cost plus a cost per token (a
compute-bound CPU's shape): the governor must run plain decoding at batch 32 and
speculation at batch 1, with a draft that is always right, and the output must equal
plain decoding's.
"""
from __future__ import annotations

import pytest

from tests.unit import eagle_utils as eu
from tests.unit import perfect_draft as pd

TREE = "chain"  # 3 draft tokens a verify: 4 tokens a request, all accepted
# Fake seconds a forward costs: fixed + per token. The draft head (one layer and an LM
# head) costs a fifth of the target per token. Batch 1: plain 15 a token, speculation
# (20 + 3 x 3 for drafting) / 4 = 7.25 a token; batch 32: plain 170 / 32 = 5.3, speculation
# (650 + 3 x 34 + an extend of 128 tokens) / 128 = 6.9 (0.77x).
TARGET_COST = (10.0, 5.0)
DRAFT_COST = (2.0, 1.0)


class CpuClock:
    """A fake clock that moves only when a forward runs, by its cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def charge(self, module, cost: tuple[float, float]) -> None:
        """Make every forward of `module` cost `cost` (fixed, per token of its batch)."""
        forward = module.forward

        def timed(fb, *args, **kwargs):
            self.now += cost[0] + cost[1] * fb.positions.numel()
            return forward(fb, *args, **kwargs)

        module.forward = timed


@pytest.fixture(scope="module")
def perfect(tmp_path_factory):
    root = tmp_path_factory.mktemp("governor_cpu")
    target = pd.make_target(root / "target", eagle3=True)
    return target, pd.perfect_eagle3(root / "draft", target)


def _clocked_engine(perfect, smollm2_dir):
    target, draft = perfect
    flags = eu.spec_flags("EAGLE3", draft, TREE) | {"speculative_adaptive": "auto"}  # the default
    engine = eu.engine(target, smollm2_dir, device="cpu", max_running_requests=32, **flags)
    worker = engine.scheduler.spec
    clock = CpuClock()
    clock.charge(engine.scheduler.runner.model, TARGET_COST)
    clock.charge(worker.proposer.model, DRAFT_COST)
    worker.governor.clock = clock
    return engine


def _generate(engine, plain, batch: int, seed: int) -> list[dict]:
    """Greedy answers to `batch` prompts at once, checked against plain decoding's."""
    prompts = eu.prompts(batch, seed=seed)
    params = {"temperature": 0, "max_new_tokens": 40}
    outs = eu.run(engine, prompts, params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in eu.run(plain, prompts, params)]
    return outs


def _steps(outs: list[dict]) -> tuple[float, float]:
    """(verifies, plain steps) per request."""
    meta = [o["meta_info"] for o in outs]
    return sum(m["spec_verify_ct"] for m in meta) / len(meta), sum(m["spec_plain_ct"] for m in meta) / len(meta)


def test_the_governor_runs_the_faster_mode_per_batch_size_on_a_cpu(perfect, smollm2_dir):
    """Speculation at batch 1, then plain decoding at batch 32 on the same engine. Past the
    governor's first measurements at batch 1 (6 speculative steps: 2 warm-up steps, 3
    samples and one decided before the third is recorded; then 4 plain) plain runs only
    as a probe. Batch 32 starts with batch 1's choice, a far bucket's guess, and probes
    plain decoding as soon as speculation has its samples there (4 steps; then one more
    while the probe's last step is recorded), not probe_every (32) steps on."""
    engine = _clocked_engine(perfect, smollm2_dir)
    governor = engine.scheduler.spec.governor
    assert governor.enabled  # auto: on, on the CPU too
    plain = eu.engine(perfect[0], smollm2_dir, device="cpu", max_running_requests=32)
    outs = _generate(engine, plain, 1, seed=3)
    spec_rate, plain_rate = governor.rates(1)
    assert spec_rate is not None and plain_rate is not None and spec_rate > 1.3 * plain_rate
    verifies, plain_steps = _steps(outs)
    assert plain_steps <= 4 and outs[0]["meta_info"]["spec_accept_length"] > 3.5, (verifies, plain_steps)
    outs = _generate(engine, plain, 32, seed=4)
    spec_rate, plain_rate = governor.rates(32)
    assert spec_rate is not None and plain_rate is not None and spec_rate < 0.9 * plain_rate
    verifies, plain_steps = _steps(outs)
    assert verifies <= 5 and plain_steps >= 19, (verifies, plain_steps)
