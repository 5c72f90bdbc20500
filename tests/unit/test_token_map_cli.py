"""`specserve token-map` (train/token_map_cli.py): the most frequent ids of a prompt set,
EOS always in, most frequent first, in the file `--speculative-token-map` loads."""
from __future__ import annotations

import json

import torch

from specserve.cli import main
from specserve.models.token_map import load_token_map
from specserve.tokenizer.tokenizer import Tokenizer
from specserve.train.token_map_cli import count_tokens, ranked_ids


def test_ranked_ids_put_eos_first_then_counts_then_lower_ids():
    counts = torch.tensor([0, 5, 2, 5, 0, 9, 1, 0])
    assert ranked_ids(counts, 5, always=[7]) == [7, 5, 1, 3, 2]
    assert ranked_ids(counts, 8) == [5, 1, 3, 2, 6, 0, 4, 7]  # unseen ids fill the tail


def test_count_tokens_reads_each_distinct_message_once():
    chats = [[{"role": "user", "content": "a b"}], [{"role": "user", "content": "a b"},
                                                   {"role": "assistant", "content": "b"}]]
    counts = count_tokens(chats, lambda text: [{"a": 1, "b": 2}[w] for w in text.split()], 4)
    assert counts.tolist() == [0, 1, 2, 0]


def test_the_command_writes_a_map_the_server_loads(smollm2_dir, tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": "split" + " banana" * 8},
                          {"role": "assistant", "content": "banana bread"},
                          {"role": "user", "content": f"another question number {i}"}]} for i in range(3)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "maps" / "freq_64.pt"
    assert main(["token-map", "--model", str(smollm2_dir), "--dataset", str(data), "--size", "64",
                 "--output", str(out)]) == 0
    ids = load_token_map(str(out), 49152).tolist()
    tok = Tokenizer.from_dir(smollm2_dir)
    assert len(ids) == 64 and set(tok.eos_token_ids) <= set(ids)
    banana = tok.encode(" banana", add_special_tokens=False)
    assert ids[len(tok.eos_token_ids)] == banana[-1]  # the most frequent word's last piece leads the counted ids
    assert "wrote 64 token ids" in capsys.readouterr().out
