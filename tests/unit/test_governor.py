"""The speculation governor: it runs the faster mode per batch size, probes the other,
and switching modes never changes the output.

Unit level with a fake clock; engine level with a governor that alternates speculative
and plain steps, for NGRAM and EAGLE-3 (random head), greedy and seeded sampling, at
batch 1 and 4: outputs equal plain decoding's and no KV slot leaks.
"""
from __future__ import annotations

import random

import pytest

from specserve import Engine
from specserve.models.draft_layouts import save_eagle3
from specserve.spec.governor import WARM_STEPS, SpecGovernor
from tests.unit.model_utils import save_tiny_hf, tiny_engine


def _warm(modes: list[bool]) -> bool:
    """Whether the last step of `modes` is one of the first WARM_STEPS of its run, as the
    worker flags it (`switched`: no sample)."""
    run = next((i for i, m in enumerate(reversed(modes)) if m != modes[-1]), len(modes))
    return run <= WARM_STEPS


def _measure(gov: SpecGovernor, bs: int, spec_rate: float, plain_rate: float, steps: int) -> list[bool]:
    """Run `steps` decisions, recording each mode at its given tokens/s per request, a
    run's first steps flagged as the worker does; return the modes."""
    modes = []
    for _ in range(steps):
        spec = gov.speculate(bs)
        modes.append(spec)
        switched = _warm(modes)
        gov.record(bs, spec, 100 * bs, 100 / (spec_rate if spec else plain_rate), switched=switched)
    return modes


def _probe_starts(modes: list[bool], mode: bool = True) -> list[int]:
    """Steps where a run of `mode` starts (after the first step)."""
    return [i for i in range(1, len(modes)) if modes[i] == mode and modes[i - 1] != mode]


def test_slow_speculation_is_turned_down_and_probed_within_the_budget():
    """Speculation 2x slower: a probe (3 steps of 0.2 s) loses 0.3 s against plain steps
    of 0.1 s; at 1% of the time since the last probe it is due every ~300 plain steps (the
    first 5 steps measure speculation: 2 warm-up steps, then enough samples to trust)."""
    gov = SpecGovernor(True, probe_every=8)
    modes = _measure(gov, 64, spec_rate=500.0, plain_rate=1000.0, steps=600)
    assert modes[:7] == [True] * 5 + [False] * 2  # measure speculation, then plain (warm-up steps first)
    assert _probe_starts(modes) == [295, 598] and modes.count(True) == 10  # probes of three steps
    spec, plain = gov.rates(64)
    assert spec == pytest.approx(500.0) and plain == pytest.approx(1000.0)


def test_leaning_is_the_better_mode_and_asks_nothing():
    """`leaning` (whether to draft the next step's trees ahead) follows the estimates (a
    bucket not measured: its nearest measured one; none: speculation) and leaves the
    probe schedule alone."""
    gov = SpecGovernor(True, probe_every=8)
    assert gov.leaning(64)  # nothing measured
    _measure(gov, 64, spec_rate=500.0, plain_rate=1000.0, steps=40)
    asked = SpecGovernor(True, probe_every=8)
    modes = []
    for _ in range(40):
        if len(modes) == 4:
            for _ in range(10):
                asked.leaning(64)
        modes.append(asked.speculate(64))
        asked.record(64, modes[-1], 6400, 100 / (500.0 if modes[-1] else 1000.0), switched=_warm(modes))
    assert not gov.leaning(64) and not asked.leaning(64)
    assert modes == _measure(SpecGovernor(True, probe_every=8), 64, 500.0, 1000.0, 40)
    assert not gov.leaning(512)  # not measured: as batch 64
    assert SpecGovernor(False).leaning(1)


def test_fast_speculation_stays_on_and_plain_is_probed_within_the_budget():
    gov = SpecGovernor(True, probe_every=8)
    modes = _measure(gov, 1, spec_rate=2000.0, plain_rate=500.0, steps=700)
    # plain measured at steps 5-7 (5 and 6 warm-up steps), then probed every 8 steps until
    # it has 3 samples; a plain probe then loses 3 x 0.2 s x 3/4 = 0.45 s, 1% of 45 s of
    # speculative steps (0.05 s each): none in the 700 steps
    assert [i for i, m in enumerate(modes) if not m] == [5, 6, 7, 16, 17, 18, 24, 25, 26]
    assert gov.rates(3) == gov.rates(4)  # 3 and 4 share the capture bucket 4
    assert gov.rates(64) == (None, None)  # another batch size is measured on its own


def test_a_speculative_step_that_drafted_nothing_is_no_sample():
    """NGRAM on code being edited: its first steps find no match (they verify nothing and
    run as decodes, a little slower than plain ones), then every step drafts and accepts
    5.5 tokens at 1.2x a plain step. The steps without a draft say nothing of
    speculation's pace: the governor stays on speculation throughout, plain decoding only
    probed now and then. Counted as samples, they turned speculation down before its first
    match, and at 1% of the time for probes it stayed down for most of the round."""
    gov = SpecGovernor(True, probe_every=8)
    plain, modes = 1e-3, []
    for i in range(600):
        spec = gov.speculate(1)
        modes.append(spec)
        drafted = spec and i >= 40
        tokens = 5.5 if drafted else 1.0
        seconds = (1.2 if drafted else 1.05 if spec else 1.0) * plain
        gov.record(1, spec, tokens, seconds, switched=_warm(modes), drafted=drafted)
    assert all(modes[:40])  # no sample of speculation yet: nothing to turn it down for
    plain_runs = "".join("p" if not m else "s" for m in modes).split("s")
    assert max(map(len, plain_runs)) <= gov.probe_steps  # plain only as probes ...
    assert sum(not m for m in modes) <= 15  # ... three to measure it, then within the budget
    spec_rate, plain_rate = gov.rates(1)
    assert spec_rate == pytest.approx(5.5 / 1.2e-3) and plain_rate == pytest.approx(1 / plain)


def test_a_proposers_hint_decides_once_both_modes_are_measured():
    """NGRAM tells before each step whether a draft would pay (a long enough match): once
    the bucket has both modes' rates, the hint picks every step, with no probe to wait for
    when the text turns repetitive and none spent where it does not."""
    gov = SpecGovernor(True, probe_every=8)
    hints, modes = [], []
    for i in range(400):
        hint = (i // 25) % 2 == 1  # stretches of copying and of new text
        spec = gov.speculate(1, hint)
        hints.append(hint)
        modes.append(spec)
        gov.record(1, spec, 6 if spec and hint else 1, 2e-3 if spec else 1e-3, switched=_warm(modes))
    # speculation measured first (3 samples after 2 warm-up steps), then plain (the same):
    # from then on every step is the hint's
    assert modes[:5] == [True] * 5 and modes[12:] == hints[12:]


def test_a_new_bucket_starts_with_its_nearest_measured_buckets_choice():
    gov = SpecGovernor(True, probe_every=8)
    assert gov.speculate(48)  # nothing measured anywhere: speculation first
    gov = SpecGovernor(True, probe_every=8)
    _measure(gov, 1, spec_rate=2000.0, plain_rate=1000.0, steps=10)
    assert _measure(gov, 64, spec_rate=500.0, plain_rate=1000.0, steps=16)[0]  # nearest: 1, speculation
    modes = _measure(gov, 48, spec_rate=500.0, plain_rate=1000.0, steps=400)  # nearest: 64
    # plain from the start, and its probes priced as at 64: speculation first measured once
    # 1% of the bucket's time pays for a probe (~300 steps), not at the first chance (8)
    assert 290 <= modes.index(True) <= 310
    spec, plain = gov.rates(48)
    assert spec == pytest.approx(500.0) and plain == pytest.approx(1000.0)
    assert gov.speculate(2)  # nearest to 1, where speculation wins


def test_traffic_change_flips_the_choice_after_a_few_probes():
    gov = SpecGovernor(True, probe_every=4)
    _measure(gov, 8, spec_rate=600.0, plain_rate=1000.0, steps=16)
    modes = _measure(gov, 8, spec_rate=4000.0, plain_rate=1000.0, steps=1200)  # drafts start to hit
    first = modes.index(True)  # when 1% of the time pays for a probe at the old estimate (0.2 s)
    assert 170 <= first <= 200
    # a probe that beats the choice is repeated probe_every steps on, and the window flips
    assert [i - first for i, m in enumerate(modes[:first + 12]) if m][:6] == [0, 1, 2, 4, 5, 6]
    assert all(modes[first + 14:first + 900])  # speculation now, plain probed as the budget allows
    assert False in modes[first + 900:]


def test_modes_sampled_at_different_sizes_of_one_bucket_compare_per_request():
    """9..16 is one bucket and a batch shrinks as requests finish, so the two modes may be
    sampled at different sizes: speculation at 16 requests (35 tokens in 3 ms) is slower
    per request than plain steps at 9 (9 tokens in 1 ms), though per batch it commits more
    tokens per second."""
    gov = SpecGovernor(True, probe_every=8)
    modes = []
    for _ in range(200):
        spec = gov.speculate(16)
        modes.append(spec)
        gov.record(16, True, 35, 3e-3) if spec else gov.record(9, False, 9, 1e-3)
    assert sum(modes[20:]) <= 8  # plain, with a probe now and then


def test_a_probe_left_unmeasured_is_retried():
    """A probe step followed by a prefill is never recorded; the governor must probe again
    rather than wait for its result forever."""
    gov = SpecGovernor(True, probe_every=8)
    modes = _measure(gov, 1, spec_rate=1000.0, plain_rate=2000.0, steps=10)
    probe = len(modes)
    while gov.speculate(1) is False:  # plain until the probe
        gov.record(1, False, 1, 1 / 2000.0)
        probe += 1
    gov.unmeasured(1, True)  # a prefill ran after the probe step
    assert gov.speculate(1)  # probed again at once
    gov.record(1, True, 1, 1 / 1000.0)
    assert _measure(gov, 1, spec_rate=1000.0, plain_rate=2000.0, steps=400).count(True) >= 2  # probing goes on


def test_a_switch_step_is_not_a_sample():
    """The first step in a mode after the other one pays for the switch (no tree drafted
    ahead, the other mode's work drained), the second lands the first early: a probe runs
    three steps and only the third is measured. Speculation slower at first, then 1.4x faster in steady state (3 tokens in
    2.1 ms against 1 in 1.0) though each of its switch steps takes 4.5 ms: the probes
    still find it, and it wins."""
    gov = SpecGovernor(True, probe_every=8)
    modes = []
    for i in range(400):
        spec = gov.speculate(1)
        modes.append(spec)
        switched = _warm(modes)
        steady = 3.6 if i < 60 else 2.1  # ms per speculative step: the traffic changes at step 60
        cost = (4.5 if switched else steady) if spec else 1.0
        gov.record(1, spec, 3 if spec else 1, cost / 1e3, switched=switched)
    assert sum(modes[20:60]) <= 10  # plain while speculation is slower (probes of 2 steps aside)
    assert sum(modes[300:]) >= 90  # speculation once it is faster, plain probed now and then


def test_a_step_that_committed_nothing_is_not_a_sample():
    """A pipeline's first step lands no tokens (they land with the next step): taken as a
    sample, its zero would sink speculation's mean tokens for the whole token window and
    hand a fresh engine to plain decoding while speculation is twice as fast."""
    gov = SpecGovernor(True, probe_every=32)
    spec = gov.speculate(1)
    gov.record(1, spec, 0, 1.5e-3)  # launched and left in flight: nothing committed
    assert gov.rates(1) == (None, None)
    modes = [spec] + _measure(gov, 1, spec_rate=2000.0, plain_rate=1000.0, steps=40)
    assert sum(modes[8:40]) >= 30  # after two plain exploration steps, speculation


def test_one_slow_step_does_not_decide():
    """A cold step (a kernel compiling, a GC pause) is outvoted: a window's slowest step is left out."""
    gov = SpecGovernor(True, probe_every=4)
    spec = gov.speculate(1)
    gov.record(1, spec, 100, 1.0)  # the first step compiled something: 1 s
    modes = _measure(gov, 1, spec_rate=2000.0, plain_rate=1000.0, steps=16)
    # two warm-up steps, two more samples, plain explored: the slow sample is left out
    assert modes[4:7] == [False] * 3 and all(modes[7:11]) and gov.leaning(1)


def test_a_periodic_slow_step_is_part_of_the_cost():
    """At batch 64 a pipelined speculative step drains and restarts its pipeline whenever
    a request ends: every third step takes 10.5 ms against 5 (2.9 tokens a request).
    Counted, speculation is slower than plain steps (1 token in 1.8 ms), 0.47 against 0.56
    tokens/ms; a median saw only the 5 ms steps (0.58) and chose speculation."""
    gov = SpecGovernor(True, probe_every=8)
    modes, spec_steps = [], 0
    for _ in range(300):
        spec = gov.speculate(64)
        modes.append(spec)
        switched = _warm(modes)
        spec_steps += spec
        seconds = (10.5 if spec_steps % 3 == 0 else 5.0) if spec else 1.8
        gov.record(64, spec, int(64 * 2.9) if spec else 64, seconds / 1e3, switched=switched)
    assert sum(modes[100:]) <= 10


def test_disabled_governor_always_speculates():
    gov = SpecGovernor(False)
    assert _measure(gov, 64, spec_rate=1.0, plain_rate=1000.0, steps=10) == [True] * 10
    assert gov.rates(64) == (None, None)


class _Alternating(SpecGovernor):
    def __init__(self, pattern: tuple[bool, ...] = (True, True, False)) -> None:  # spec, spec, plain, ...
        super().__init__(True)
        self.pattern = pattern
        self.modes: list[bool] = []

    def speculate(self, bs: int, hint: bool | None = None) -> bool:
        self.modes.append(self.pattern[len(self.modes) % len(self.pattern)])
        return self.modes[-1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("governor")
    target = save_tiny_hf("llama", root / "target", vocab_size=49152, max_position_embeddings=1024,
                          num_hidden_layers=4)
    rng = random.Random(1)
    # Repetitive prompts so NGRAM drafts get accepted sometimes.
    prompts = [[rng.randrange(3, 200) for _ in range(6)] * 4 for _ in range(4)]
    return target, prompts, save_eagle3(root / "eagle3", target, draft_vocab=4096)


def _engine(target, smollm2_dir, **flags) -> Engine:
    return tiny_engine(target, smollm2_dir, **flags)


@pytest.mark.slow
@pytest.mark.parametrize("algo,overlap", [("NGRAM", False), ("EAGLE3", False), ("NGRAM", True), ("EAGLE3", True)])
def test_switching_modes_keeps_outputs_exact(tiny, smollm2_dir, algo, overlap):
    """Overlap: runs of plain steps are overlapped (launched before the last is read back,
    as on a GPU), and drained before each speculative step."""
    target, prompts, head = tiny
    greedy = {"temperature": 0, "max_new_tokens": 20}
    sampled = [{"temperature": 1.0, "max_new_tokens": 12, "seed": 10 + i} for i in range(len(prompts))]
    plain = _engine(target, smollm2_dir)
    want_greedy = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=greedy)]
    want_sampled = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=sampled)]
    flags = {"speculative_algorithm": algo, "speculative_adaptive": "on"}
    if algo == "EAGLE3":
        flags |= {"speculative_draft_model_path": str(head), "speculative_num_steps": 3,
                  "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6}
    engine = _engine(target, smollm2_dir, **flags)
    gov = engine.scheduler.spec.governor = _Alternating((True, False, False, False) if overlap else (True, True, False))
    engine.scheduler.overlap = overlap
    single = engine.generate(input_ids=prompts[0], sampling_params=greedy)
    assert single["output_ids"] == want_greedy[0]
    outs = engine.generate(input_ids=prompts, sampling_params=greedy)
    assert [o["output_ids"] for o in outs] == want_greedy
    outs = engine.generate(input_ids=prompts, sampling_params=sampled)
    assert [o["output_ids"] for o in outs] == want_sampled
    assert True in gov.modes and False in gov.modes
    assert not engine.scheduler.has_work and engine.scheduler._inflight is None
    engine.scheduler.kv.flush_cache()
    engine.scheduler.kv.assert_no_leak()


@pytest.mark.parametrize("spec_ms,want_spec", [(3.3, True), (4.5, False)])
def test_noisy_batch_one_acceptance_settles_on_the_faster_mode(spec_ms, want_spec):
    """At batch 1 a verify commits 1 to 6 tokens: a few unlucky steps must not park the
    governor on plain decoding when speculation is 1.24x faster (3.4 tokens in 3.3 ms vs
    1 in 1.23 ms), nor keep it speculating when it is 0.92x (4.5 ms)."""
    rng = random.Random(1)
    gov = SpecGovernor(True)
    modes = []
    for _ in range(4000):
        spec = gov.speculate(1)
        modes.append(spec)
        tokens = rng.choice([1, 2, 3, 4, 5, 6, 1, 3, 4, 5]) if spec else 1
        gov.record(1, spec, tokens, (spec_ms if spec else 1.23) * rng.uniform(0.95, 1.05) / 1e3)
    share = sum(modes[500:]) / len(modes[500:])
    assert share > 0.9 if want_spec else share < 0.1


def test_a_clearly_slower_mode_is_probed_rarely_but_a_close_call_often():
    """Speculation 1.4x slower (batch 64 on H100) is probed as 1% of the time pays for a
    probe (its 3 steps of 0.1 s lose 0.3 x 405/1405 s: 121.5 plain steps of 100/1405 s);
    1.05x slower costs so little to probe that it is probed every probe_every steps (its
    estimate must keep up). Neither sits on the budget's edge, where rounding decides."""
    for plain_rate, gap in ((1405.0, 122), (1050.0, 29)):
        gov = SpecGovernor(True, probe_every=32)
        modes = _measure(gov, 64, spec_rate=1000.0, plain_rate=plain_rate, steps=600)
        starts = _probe_starts(modes)  # probes of 3 steps
        gaps = {b - (a + 3) for a, b in zip(starts[1:], starts[2:])}  # from a probe's end to the next
        assert gaps == {gap}, (plain_rate, gaps)


def test_a_bad_stretch_of_drafts_is_forgotten_within_a_few_probes():
    """Speculation 1.9x faster at batch 1 (3.5 tokens in 1 ms against 1 in 0.55) but for
    a stretch of text where every draft misses: the governor turns to plain decoding, and
    once drafts hit again, a few probes bring speculation back. Samples weigh by their age
    in the bucket's steps, so the bad stretch fades while plain steps run; with a plain
    mean of speculation's last 64 samples, each probe replaced one sixty-fourth of it and
    batch 1 ran ~650 plain steps before speculation resumed."""
    for bad_steps in (200, 400):
        gov = SpecGovernor(True)
        modes = []
        for i in range(1700):
            spec = gov.speculate(1)
            modes.append(spec)
            bad = 300 <= i < 300 + bad_steps
            tokens = (1 if bad else 3.5) if spec else 1
            gov.record(1, spec, tokens, 1e-3 if spec else 0.55e-3, switched=_warm(modes))
        assert sum(modes[220 + bad_steps:300 + bad_steps]) <= 6, bad_steps  # plain by its end, 2 probes aside
        after = modes[300 + bad_steps:]
        back = next(j for j in range(len(after)) if all(after[j:j + 20]))  # a run of 20 speculative steps
        assert back <= 120, (bad_steps, back)


def test_probes_are_priced_with_what_their_switches_cost():
    """Speculation 1.5x faster (3 tokens in 1 ms against 1 in 0.5) but the first two steps
    of a speculative run take 3 ms (no tree drafted ahead), plain steps none longer. A
    probe of plain decoding loses 0.5 ms in its steps and 4 ms in the warm-up back, so at
    1% of the time it is due every ~450 speculative steps, not every ~50 as its steps
    alone would have it."""
    gov = SpecGovernor(True)
    modes = []
    for _ in range(3000):
        spec = gov.speculate(1)
        modes.append(spec)
        switched = _warm(modes)
        seconds = (3e-3 if switched else 1e-3) if spec else 0.5e-3
        gov.record(1, spec, 3 if spec else 1, seconds, switched=switched)
    starts = _probe_starts(modes, mode=False)  # probes of plain decoding
    gaps = [b - a for a, b in zip(starts[1:], starts[2:])][1:]  # once a switch is measured
    assert len(gaps) >= 4 and all(420 <= g <= 480 for g in gaps), gaps


def test_host_pauses_in_a_probed_modes_window_are_not_its_cost():
    """A mode only probed takes one time sample a probe: two host pauses (10 ms against
    1 ms steps) in its window of 8 would outlast many probes. Speculation 1.7x faster is
    sampled with two pauses among its steps, then plain decoding is measured: speculation
    still wins, its step time the steady 1 ms."""
    gov = SpecGovernor(True)
    modes = []
    for i in range(60):
        spec = gov.speculate(1)
        modes.append(spec)
        seconds = (10e-3 if i in (10, 12) else 1e-3) if spec else 0.55e-3
        gov.record(1, spec, 3 if spec else 1, seconds, switched=_warm(modes))
    assert gov._time[(1, True)] == pytest.approx(1e-3)
    assert gov.leaning(1) and sum(modes[20:]) >= 34  # speculation, plain probed


class _Clocked(_Alternating):
    """Alternates modes on a fake clock that ticks 1 ms a reading; keeps every sample."""

    def __init__(self, pattern: tuple[bool, ...]) -> None:
        super().__init__(pattern)
        self.now, self.samples = 0.0, []
        self.clock = self._tick

    def _tick(self) -> float:
        self.now += 1e-3
        return self.now

    def record(self, bs, speculated, tokens, seconds, switched=False, drafted=True) -> None:
        self.samples.append((speculated, seconds, switched))
        super().record(bs, speculated, tokens, seconds, switched, drafted)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_drain_at_a_mode_switch_is_charged_to_no_step(tiny, smollm2_dir, overlap):
    """At a switch the worker drains the GPU work the last step left queued (a pipelined
    step's whole next step); closed after it, that step's time would count the drain and
    halve its mode's first rate. Here a drain takes 1 s of the fake clock: no sample has it."""
    target, prompts, head = tiny
    engine = _engine(target, smollm2_dir, speculative_algorithm="EAGLE3", speculative_adaptive="on",
                     speculative_draft_model_path=str(head), speculative_num_steps=3,
                     speculative_eagle_topk=2, speculative_num_draft_tokens=6)
    worker = engine.scheduler.spec
    gov = worker.governor = _Clocked((True, True, True, False, False, False))
    drains = []

    def drain() -> None:
        drains.append(gov.now)
        gov.now += 1.0

    worker._drain = drain
    engine.scheduler.overlap = overlap
    engine.generate(input_ids=prompts[0], sampling_params={"temperature": 0, "max_new_tokens": 24})
    switches = sum(a != b for a, b in zip(gov.modes, gov.modes[1:]))
    assert switches >= 4 and len(drains) == switches
    assert {s for s, _, _ in gov.samples} == {True, False}
    assert max(seconds for _, seconds, _ in gov.samples) < 0.5, gov.samples
    engine.scheduler.kv.flush_cache()
    engine.scheduler.kv.assert_no_leak()
