"""`specserve bench serving --offline`: the real server and the offline Engine on the same
prompts, in one run, on a tiny random-weights model on the CPU."""
from __future__ import annotations

import json
from pathlib import Path

import tokenizers

from specserve.bench import serving

VOCAB = 256


def _model_dir(root: Path) -> Path:
    """A two-layer Llama with random weights (--load-format dummy) and a word tokenizer."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": VOCAB, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
           "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
    (root / "config.json").write_text(json.dumps(cfg))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(root / "tokenizer.json"))
    return root


def test_serving_against_offline_reports_both(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    out = tmp_path / "rows.jsonl"
    args = ["--server-args", f"--model-path {model} --load-format dummy --device cpu", "--concurrency", "2",
            "--num-prompts", "4", "--max-tokens", "6", "--ignore-eos", "--offline", "--output", str(out)]
    assert serving.main(args) == 0
    row = json.loads(out.read_text().splitlines()[-1])
    assert row["output_tokens"] == 4 * 6  # every answer ran to --max-tokens
    assert row["offline_tok_s"] > 0 and row["output_tok_s"] > 0
    assert abs(row["server_over_offline"] - row["output_tok_s"] / row["offline_tok_s"]) < 1e-9
