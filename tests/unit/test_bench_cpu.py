"""`specserve bench cpu`: its rows on the real SmolLM2 (two CPU engines, no llama.cpp here)."""
from __future__ import annotations

import json

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
    assert all(r["tok_s"] > 0 and r["threads"] == torch.get_num_threads() and r["num_prompts"] == 2
               and r["prompts"] == "repetitive" for r in rows)
    assert "llama.cpp: skipped" in capsys.readouterr().out
