"""`specserve bench ngram-cost` (the NGRAM trie's host cost, no model) at a small size: a
batch of one never fills the trie, which the line says instead of failing (it asserted)."""
from __future__ import annotations

from specserve.bench import ngram_cost


def test_a_run_too_small_to_fill_the_trie_reports_it(capsys) -> None:
    assert ngram_cost.main(["--batch", "1", "--history", "60", "--steps", "4"]) == 0
    line = capsys.readouterr().out
    assert line.startswith("ngram_cost bs=1") and "at capacity 100000: not reached (nothing evicted)" in line
