"""NGRAM's pipelined steps (spec/ngram/lookup.py, adapter.py): drafts made on the device from
each request's own tokens and drafted ahead from the walk, so step k+1 is launched before
step k is read back. Switched on by SPECSERVE_NGRAM_ON_DEVICE=1. On the CPU the pipeline is forced on (the
scheduler turns it on with CUDA graphs); the device state it drafts from is the same. Checked:
  * greedy output equals plain decoding's, token for token, at batch 1, 6 and 10 (above
    adapter.DEVICE_ROWS the trie drafts; the batch shrinks past it and the device's ids
    are synced from the host's), with requests ending at different steps;
  * the device drafts pay where the text repeats (accepted drafts), and most steps are
    left in flight;
  * no KV slot leaks (`run` checks the allocator after each batch).
"""
from __future__ import annotations

import random

import pytest

from specserve.spec.ngram import adapter
from specserve.spec.pipeline import InFlightSpec
from tests.unit.eagle_utils import clean, count_calls, engine, run, tiny_target

pytestmark = pytest.mark.slow


def _repeating(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random phrase a few times: their answers' prefixes have matches."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, 49152) for _ in range(rng.randrange(3, 9))]
        out.append((phrase * rng.randrange(2, 5))[: rng.randrange(8, 30)])
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    target = tiny_target(tmp_path_factory.mktemp("ngram_pipeline") / "target")
    ps = _repeating(10, seed=3)
    params = [{"temperature": 0, "max_new_tokens": 40 - 3 * (i % 4)} for i in range(10)]
    ref = [o["output_ids"] for o in run(engine(target, smollm2_dir), ps, params)]
    return target, ps, params, ref


def _pipelined(target, smollm2_dir, monkeypatch, counts: dict):
    monkeypatch.setenv("SPECSERVE_NGRAM_ON_DEVICE", "1")
    eng = engine(target, smollm2_dir, speculative_algorithm="NGRAM", speculative_adaptive="off",
                 speculative_num_draft_tokens=6)
    worker = eng.scheduler.spec
    worker.pipeline = True  # as the scheduler sets it with CUDA graphs
    worker.capture_graphs(8)  # NGRAM's whole_step: small batches draft on the device
    for obj, name in ((worker, "_launch"), (worker, "_land"), (InFlightSpec, "drop"), (worker, "drain")):
        count_calls(obj, name, counts, monkeypatch)
    return eng


def test_pipelined_ngram_steps_are_token_identical(tiny, smollm2_dir, monkeypatch):
    target, ps, params, ref = tiny
    counts: dict = {}
    eng = _pipelined(target, smollm2_dir, monkeypatch, counts)
    assert eng.scheduler.spec.proposer.lookup is not None and adapter.DEVICE_ROWS < len(ps)
    outs = run(eng, ps[:1], params[:1]) + run(eng, ps[1:7], params[1:7]) + run(eng, ps, params)
    want = ref[:1] + ref[1:7] + ref
    assert [o["output_ids"] for o in outs] == want
    # steps were left in flight and read back a step later; batches shrank as requests ended
    assert counts["_launch"] >= 10 and counts["_land"] >= counts["_launch"] - 4, counts
    assert counts.get("drop", 0) >= 2, counts
    # the device drafts were accepted where the answers repeat what came before
    assert max(o["meta_info"]["spec_accept_length"] for o in outs) > 1.5, [o["meta_info"] for o in outs]
    clean(eng)
    # the trie's forecast says nothing of the device's drafts: the governor decides alone
    proposer = eng.scheduler.spec.proposer
    proposer.on_price(1.2)
    assert proposer.drafts_pay([]) is None


def test_without_the_switch_ngram_keeps_the_trie(tiny, smollm2_dir, monkeypatch):
    target, ps, params, ref = tiny
    monkeypatch.delenv("SPECSERVE_NGRAM_ON_DEVICE", raising=False)
    eng = engine(target, smollm2_dir, speculative_algorithm="NGRAM", speculative_adaptive="off")
    worker = eng.scheduler.spec
    worker.pipeline = True
    worker.capture_graphs(8)
    assert worker.proposer.lookup is None and not worker.proposer.can_draft_ahead(1)
    assert [o["output_ids"] for o in run(eng, ps[:2], params[:2])] == ref[:2]


def test_sampled_requests_take_device_drafts_unpipelined(tiny, smollm2_dir, monkeypatch):
    """Seeded sampling (temperature, top-p) next to a greedy request: such a batch is not
    left in flight, yet it drafts on the device (chains from `DeviceLookup.draft`); seeded
    outputs are plain sampling's, token for token."""
    target, ps, _, _ = tiny
    params = [{"temperature": t, "seed": 31 + i, "max_new_tokens": 24, **extra}
              for i, (t, extra) in enumerate(((1.0, {}), (0.0, {}), (0.8, {"top_p": 0.9})))]
    want = [o["output_ids"] for o in run(engine(target, smollm2_dir), ps[:3], params)]
    counts: dict = {}
    eng = _pipelined(target, smollm2_dir, monkeypatch, counts)
    count_calls(eng.scheduler.spec.proposer.lookup, "draft", counts, monkeypatch)
    assert [o["output_ids"] for o in run(eng, ps[:3], params)] == want
    assert counts.get("draft", 0) >= 5 and counts.get("_launch", 0) == 0, counts
