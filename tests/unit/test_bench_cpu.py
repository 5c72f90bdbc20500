"""`specserve bench cpu`: its rows on the real SmolLM2 (two CPU engines, no llama.cpp here)."""
from __future__ import annotations

import json

import pytest
import torch

from specserve.bench import cpu


def test_rows_and_a_missing_llama_cpp(smollm2_dir, tmp_path, capsys):
    out = tmp_path / "cpu.jsonl"
    argv = ["--configs", "float,gguf", "--prompts", "repetitive", "--num-prompts", "2", "--max-new-tokens", "4", "--no-hf",
            "--llama-bench", "no-such-llama-bench", "--output", str(out)]  # no --threads: it would stay set
    assert cpu.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["engine"], r["weights"]) for r in rows] == [("specserve float", "float32"), ("specserve gguf", "gguf")]
    assert rows[1]["vs_gguf_plain"] == 1.0 and rows[1]["same_as_gguf_plain"] == 2
    assert all(r["tok_s"] > 0 and r["decode_tok_s"] > 0 and r["threads"] == torch.get_num_threads() and r["num_prompts"] == 2
               and r["prompts"] == "repetitive" for r in rows)
    assert "llama.cpp: skipped" in capsys.readouterr().out


def test_llama_cpp_rows_come_from_its_pp_and_tg_tests(smollm2_dir, tmp_path, monkeypatch):
    """llama-bench's CSV (a stand-in script here, which logs its arguments): it takes a turn
    after each prompt, at that prompt's length, one run each; its `tg` rate is the decoding
    row, and its end-to-end row is our prompts' prefill at its `pp` rate plus plain's tokens
    at `tg`."""
    exe, calls = tmp_path / "llama-bench", tmp_path / "calls"
    exe.write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho \'"n_prompt","n_gen","avg_ts"\'\n'
                   'echo \'"40","0","400.0"\'\necho \'"0","4","50.0"\'\n')
    exe.chmod(0o755)
    monkeypatch.setattr(cpu, "_gguf_file", lambda model, into: tmp_path / "model.gguf")
    out = tmp_path / "cpu.jsonl"
    argv = ["--configs", "gguf", "--num-prompts", "2", "--max-new-tokens", "4", "--no-hf",
            "--llama-bench", str(exe), "--output", str(out)]
    assert cpu.main(argv) == 0
    plain, llama = [json.loads(line) for line in out.read_text().splitlines()]
    turns = [line.split() for line in calls.read_text().splitlines()]
    assert len(turns) == 2 and all(t[t.index("-r") + 1] == "1" and t[t.index("-n") + 1] == "4" for t in turns)
    assert sum(int(t[t.index("-p") + 1]) for t in turns) == llama["prompt_tokens"]
    assert (llama["decode_tok_s"], llama["prefill_tok_s"]) == (50.0, 400.0)
    seconds = llama["prompt_tokens"] / 400.0 + plain["tokens"] / 50.0
    assert llama["tok_s"] == pytest.approx(plain["tokens"] / seconds)
    assert plain["decode_vs_llama_cpp"] == pytest.approx(plain["decode_tok_s"] / 50.0)


def test_spread_prompts_cover_every_category():
    from specserve.bench.cpu import _texts
    from specserve.bench.prompts import mt_bench_first_turns

    every = mt_bench_first_turns()
    spread = _texts("mtbench-spread", 8)
    assert spread == every[::10] and _texts("mtbench", 3) == every[:3]  # MT-bench: 8 categories of 10
