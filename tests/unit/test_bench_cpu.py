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
    """llama-bench's CSV (a stand-in script here): its `tg` rate is the decoding row, and its
    end-to-end row is our prompts' prefill at its `pp` rate plus plain's tokens at `tg`."""
    exe = tmp_path / "llama-bench"
    exe.write_text('#!/bin/sh\necho \'"n_prompt","n_gen","avg_ts"\'\necho \'"40","0","400.0"\'\n'
                   'echo \'"0","4","50.0"\'\n')
    exe.chmod(0o755)
    monkeypatch.setattr(cpu, "_gguf_file", lambda model, into: tmp_path / "model.gguf")
    out = tmp_path / "cpu.jsonl"
    argv = ["--configs", "gguf", "--num-prompts", "2", "--max-new-tokens", "4", "--no-hf",
            "--llama-bench", str(exe), "--output", str(out)]
    assert cpu.main(argv) == 0
    plain, llama = [json.loads(line) for line in out.read_text().splitlines()]
    assert (llama["decode_tok_s"], llama["prefill_tok_s"]) == (50.0, 400.0)
    seconds = llama["prompt_tokens"] / 400.0 + plain["tokens"] / 50.0
    assert llama["tok_s"] == pytest.approx(plain["tokens"] / seconds)
    assert plain["decode_vs_llama_cpp"] == pytest.approx(plain["decode_tok_s"] / 50.0)
