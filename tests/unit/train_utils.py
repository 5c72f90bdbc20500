"""A tiny target for the train-draft tests: a 4-layer random llama of VOCAB ids with its own
word-level tokenizer (nothing fetched), its final norm scaled up so its greedy choices are
confident, and a prompt file holding three rows the data filters must drop."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from specserve.bench.prompts import MT_BENCH, humaneval_prompts, humaneval_stubs
from specserve.models.draft_layouts import read_tensors
from tests.unit.model_utils import save_tiny_hf

VOCAB = 512
WORDS = ("what is the capital of france write a haiku about rain explain gravity simply list three fruits "
         "how do i boil an egg name famous painter count to five say hello tell me story").split()
PROMPTS = ["What is the capital of France?", "write a haiku about rain", "explain gravity simply",
           "list three fruits", "how do I boil an egg", "name a famous painter", "count to five",
           "say hello", "tell me a story about rain", "what is gravity"]


def word_tokenizer(path: Path) -> None:
    """A WordLevel tokenizer of exactly VOCAB ids (ChatML specials, our words, fillers)."""
    vocab = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"] + list(dict.fromkeys(WORDS))
    vocab += [f"w{i}" for i in range(VOCAB - len(vocab))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))


def sharpen(path: Path, factor: float) -> None:
    """Scale the final norm: logits x factor, so the random model's greedy choices are clear."""
    t = read_tensors(path)
    t["model.norm.weight"] = t["model.norm.weight"] * factor
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})


def make_tiny(root: Path) -> tuple[Path, Path, Path]:
    """(root, the target's directory, the prompts .jsonl) under root."""
    target = save_tiny_hf("llama", root / "target", vocab_size=VOCAB, max_position_embeddings=256,
                          num_hidden_layers=4)
    sharpen(target, 30.0)
    word_tokenizer(target)
    data = root / "prompts.jsonl"
    bench = json.loads(MT_BENCH.read_text().splitlines()[0])["turns"][0]
    rows = [{"prompt": p} for p in PROMPTS] + [
        {"prompt": "  " + bench.upper().replace(" ", "   ") + " "},  # an MT-bench question: dropped
        {"conversations": [{"from": "human", "value": f"please answer: {bench}"}]},  # contains one: dropped
        {"messages": [{"role": "user", "content": PROMPTS[0].lower()}]},  # a duplicate: dropped
        {"prompt": humaneval_prompts(3)[2]},  # a HumanEval ask (it holds the stub): dropped
        {"prompt": "fix my code:" + humaneval_stubs()[4]},  # a HumanEval stub asked another way: dropped
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, target, data
