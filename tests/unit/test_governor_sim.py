"""`specserve bench governor-sim`: the governor on a simulated batch-1 MT-bench round.

Where speculation is ~2x faster (the default traffic) the governor costs little against
always speculating; where drafts mostly miss, it beats always speculating by turning to
plain decoding. Every policy sees the same text, so a seed's rounds are comparable.
"""
from __future__ import annotations

from specserve.bench.governor_sim import Traffic, compare, main, run, texts


def test_the_same_seed_is_the_same_text_and_the_same_round():
    t = Traffic()
    assert texts(t, 3) == texts(t, 3) != texts(t, 4)
    assert run(t, 3, True) == run(t, 3, True)
    always = run(t, 3, False)
    assert always["plain_steps"] == 0 and 1500 < always["tok_s"] < 6000


def test_the_governor_costs_little_where_speculation_wins_and_saves_where_it_loses():
    good = compare(Traffic(), range(2))
    assert all(0.95 < r["ratio"] <= 1.0 for r in good), good
    bad = compare(Traffic(accept_mean=0.15, accept_sd=0.02, stretch_sd=0.02), range(2))
    assert all(r["ratio"] > 1.05 and r["plain_steps"] > 5 * r["spec_steps"] for r in bad), bad


def test_the_cli_prints_one_row_per_seed_and_the_summary(capsys):
    assert main(["--seeds", "1", "--pause-rate", "0"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith('{"seed": 0') and "mean" in lines[1]
