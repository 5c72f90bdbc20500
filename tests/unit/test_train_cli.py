"""`specserve train-draft`'s data filters and command line, on the tiny target of
train_utils (prompt files, ShareGPT turns, the flags and their errors)."""
from __future__ import annotations

import json

import pytest

from specserve import Engine
from specserve.bench.prompts import MT_BENCH
from specserve.cli import main as specserve_main
from specserve.train.cli import build_parser, config_from_args
from specserve.train.data import decode_truncated_array, load_chats
from specserve.train.regen import RegenConfig, choose_prompts
from tests.unit.train_utils import PROMPTS, make_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("train_cli"))


def test_prompts_skip_benchmark_questions_and_duplicates(tiny):
    _, _, data = tiny
    assert load_chats(str(data)) == [[{"role": "user", "content": p}] for p in PROMPTS]
    truncated = '[{"a": 1}, {"b": [2, 3]},\n {"c": "cut here'
    assert decode_truncated_array(truncated) == [{"a": 1}, {"b": [2, 3]}]
    assert decode_truncated_array('[{"a": 1} ]') == [{"a": 1}]


def test_all_turns_are_prompts_with_their_conversation_before_them(tiny, tmp_path):
    """turns="all": one chat per user turn, the record's earlier turns (roles mapped, empty
    ones left out) before it; a chat is dropped when any of its user turns holds an MT-bench
    question, and "first" keeps the first user turns alone. Each chosen prompt's ids are
    the chat template of its whole chat."""
    _, target, _ = tiny
    bench = json.loads(MT_BENCH.read_text().splitlines()[1])["turns"][0]
    u, a = (lambda t: {"role": "user", "content": t}), (lambda t: {"role": "assistant", "content": t})
    sharegpt = lambda *turns: {"conversations": [{"from": f, "value": v} for f, v in turns]}  # noqa: E731
    rows = [sharegpt(("human", "say hello"), ("gpt", "hello"), ("human", "count to five"), ("gpt", "  "),
                     ("human", "list three fruits")),
            sharegpt(("gpt", "what is gravity"), ("human", "explain gravity simply"), ("tool", "x")),
            sharegpt(("human", "name a famous painter"), ("gpt", "rain"), ("human", f"now: {bench}"),
                     ("gpt", "five"), ("human", "write a haiku about rain")),
            {"messages": [{"role": "user", "content": "say hello"}]}]  # the same chat as row 0's first
    data = tmp_path / "turns.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    chats = load_chats(str(data), "all")
    assert chats == [[u("say hello")], [u("say hello"), a("hello"), u("count to five")],
                     [u("say hello"), a("hello"), u("count to five"), u("list three fruits")],
                     [a("what is gravity"), u("explain gravity simply")], [u("name a famous painter")]]
    assert load_chats(str(data)) == [[u(p)] for p in ("say hello", "explain gravity simply",
                                                      "name a famous painter")]
    with pytest.raises(ValueError, match="turns must be one of"):
        load_chats(str(data), "last")
    tok = Engine(str(target), device="cpu", log_level="warning").tokenizer
    chosen = choose_prompts(chats, tok, RegenConfig(str(target), str(data), 3, 8, 128, turns="all"))
    assert len(chosen) == 3 and all(c["messages"] in chats for c in chosen)
    assert all(c["ids"] == tok.encode_chat(c["messages"]) for c in chosen)
    assert len({len(c["ids"]) for c in chosen}) > 1


def test_cli(tiny, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        specserve_main(["train-draft", "--help"])
    assert e.value.code == 0 and "--ttt-steps" in capsys.readouterr().out
    base = ["train-draft", "--model", str(tiny[1]), "--output", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as e:
        specserve_main(base + ["--algorithm", "MEDUSA"])
    assert e.value.code == 2 and "unsupported algorithm 'MEDUSA'" in capsys.readouterr().err
    assert specserve_main(base + ["--algorithm", "EAGLE", "--draft-vocab-size", "64"]) == 2
    assert "EAGLE3 only" in capsys.readouterr().err
    assert specserve_main(base + ["--resume", "--device", "cpu"]) == 2
    assert "no train_state.pt" in capsys.readouterr().err
    assert specserve_main(base + ["--time-limit", "0"]) == 2
    assert "--time-limit must be positive" in capsys.readouterr().err
    args = ["--model", "m", "--output", "o", "--max-running-requests", "512", "--time-limit", "60"]
    cfg = config_from_args(build_parser().parse_args(args))
    assert cfg.engine_args == {"max_running_requests": 512, "cuda_graph_max_bs": 512,
                               "num_continuous_decode_steps": 16} and cfg.time_limit == 60 and cfg.turns == "first"
    assert config_from_args(build_parser().parse_args(args + ["--num-continuous-decode-steps", "1"])) \
        .engine_args["num_continuous_decode_steps"] == 1
    assert config_from_args(build_parser().parse_args(args + ["--turns", "all"])).turns == "all"
    assert config_from_args(build_parser().parse_args(args + ["--extra-temperatures", "0.7,1"])) \
        .extra_temperatures == (0.7, 1.0)
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(args + ["--extra-temperatures", "0,1"])
    assert e.value.code == 2 and "must be in (0, 100]" in capsys.readouterr().err
