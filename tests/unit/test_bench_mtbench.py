"""`specserve bench mtbench` end to end on CPU, with a tiny random Llama target.

The target gets a small byte-level BPE tokenizer (trained here on the built-in repetitive
prompt set, never on MT-bench) and the default ChatML template, so the benchmark runs
exactly as on a real model: chat-templated MT-bench prompts, every method in its own engine,
greedy. Checks: a row per method and batch size, speculative answers token-identical to
plain for every question (fp32, lossless speculation), parseable JSON lines, second-turn
prompts built from the model's own first answers, transformers rows, loud failures for a bad
draft, and the plot (or its note without matplotlib).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from specserve.bench import mtbench, prompts
from specserve.bench.repetitive import repetitive_prompts
from specserve.models.draft_layouts import save_eagle3
from tests.unit.model_utils import save_tiny_hf

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _save_tokenizer(path: Path, vocab_size: int) -> int:
    """A byte-level BPE tokenizer in `path` (EOS <|im_end|>); returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(repetitive_prompts(), trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return tok.get_vocab_size()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny random Llama target with a tokenizer, and a random EAGLE-3 head for it."""
    root = tmp_path_factory.mktemp("mtbench")
    vocab = _save_tokenizer(root / "tok", 512)
    target = save_tiny_hf("llama", root / "target", vocab_size=vocab, max_position_embeddings=2048,
                          num_hidden_layers=4)  # EAGLE-3's default aux layers need 4
    for f in (root / "tok").iterdir():
        f.rename(target / f.name)
    return {"target": target, "eagle3": save_eagle3(root / "eagle3", target, draft_vocab=128), "root": root,
            "vocab": vocab}


def _argv(tiny, out: Path, *extra: str) -> list[str]:
    return ["--model", str(tiny["target"]), "--device", "cpu", "--dtype", "float32",
            "--output", str(out / "rows.jsonl"), "--plot", str(out / "chart.png"), *extra]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_turn(tiny, tmp_path_factory):
    """plain, EAGLE-3 and NGRAM at bs 1 and 2, first turns, no transformers."""
    out = tmp_path_factory.mktemp("one_turn")
    argv = _argv(tiny, out, "--eagle3-draft", str(tiny["eagle3"]), "--ngram", "--no-hf",
                 "--num-questions", "3", "--max-new-tokens", "6", "--batch-sizes", "1,2",
                 "--spec-args", "speculative_num_steps=2,speculative_eagle_topk=1,speculative_num_draft_tokens=3,"
                 "speculative_adaptive=off")
    assert mtbench.main(argv) == 0
    return out


def test_rows_for_every_method_and_batch_size(one_turn):
    rows = _rows(one_turn)
    assert [(r["method"], r["batch_size"]) for r in rows] == [
        (m, bs) for bs in (1, 2) for m in ("plain", "EAGLE-3", "NGRAM")]
    for r in rows:
        assert r["bench"] == "mtbench" and r["num_questions"] == 3 and r["turns"] == 1
        assert r["identical_outputs"] == 3, r  # greedy fp32: speculation is lossless
        assert r["identical_to_first_bs"] == 3, r  # ... and batching too
        assert r["tok_s"] > 0 and r["seconds"] > 0 and 3 <= r["tokens"] <= 3 * 6
        assert r["accept_length"] >= 1.0
        assert r["device"] == "cpu" and r["dtype"] == "float32"
    plain = {r["batch_size"]: r for r in rows if r["method"] == "plain"}
    for r in rows:
        assert r["tokens"] == plain[r["batch_size"]]["tokens"]
        assert r["speedup"] == pytest.approx(r["tok_s"] / plain[r["batch_size"]]["tok_s"])
    assert all(r["speedup"] == 1.0 and r["accept_length"] == 1.0 for r in plain.values())
    eagle3 = [r for r in rows if r["method"] == "EAGLE-3"]
    assert all(r["draft"] and r["spec_args"].startswith("speculative_num_steps=2") for r in eagle3)
    # the governor is off here: every EAGLE-3 step drafted, and plain decoding has none to count
    assert all(r["plain_steps"] == 0 for r in eagle3 + list(plain.values()))


def test_rounds_report_the_middle_one(tiny, tmp_path):
    """`--rounds 3` times each engine three times and keeps the round of median tokens/s;
    the outputs are those of every round (greedy)."""
    argv = _argv(tiny, tmp_path, "--no-hf", "--num-questions", "2", "--max-new-tokens", "4", "--batch-sizes", "1",
                 "--rounds", "3", "--ngram")
    assert mtbench.main(argv) == 0
    rows = _rows(tmp_path)
    assert [r["rounds"] for r in rows] == [3, 3] and all(r["identical_outputs"] == 2 for r in rows)
    answers = [mtbench.Answers(seconds, [[[1, 2, 3]]], 0) for seconds in (3.0, 1.0, 2.0, 4.0)]
    assert mtbench.middle_round(answers[:3]).seconds == 2.0
    assert mtbench.middle_round(answers).seconds == 3.0  # the slower of the two middle rounds
    with pytest.raises(SystemExit):
        mtbench._parser().parse_args(["--rounds", "0"])


def test_sampling_filters_reach_every_request_and_the_summary(tiny, tmp_path):
    """--top-p/--top-k/--min-p go with --temperature into every request (speculative
    sampling stays seeded plain sampling's, filters included) and into the row and summary."""
    argv = _argv(tiny, tmp_path, "--no-hf", "--num-questions", "2", "--max-new-tokens", "4", "--batch-sizes", "1",
                 "--temperature", "1.0", "--top-p", "0.9", "--top-k", "20", "--ngram")
    assert mtbench.main(argv) == 0
    rows = _rows(tmp_path)
    assert all(r["filters"] == {"top_p": 0.9, "top_k": 20} for r in rows)
    assert all(r["identical_outputs"] == 2 for r in rows)
    assert "temperature 1, top-p 0.9, top-k 20, seeded" in mtbench.summary(rows)
    assert mtbench.filters(mtbench._parser().parse_args([])) == {}


def test_several_eagle3_heads_get_a_row_each(tiny, tmp_path):
    """Repeating --eagle3-draft compares heads in one run: a row per head, named by its directory."""
    other = save_eagle3(tmp_path / "other", tiny["target"], draft_vocab=64)
    argv = _argv(tiny, tmp_path, "--eagle3-draft", str(tiny["eagle3"]), "--eagle3-draft", str(other), "--no-hf",
                 "--num-questions", "2", "--max-new-tokens", "4", "--batch-sizes", "1",
                 "--spec-args", "speculative_num_steps=2,speculative_eagle_topk=1,speculative_num_draft_tokens=3")
    assert mtbench.main(argv) == 0
    rows = _rows(tmp_path)
    assert [(r["method"], r["draft"]) for r in rows] == [
        ("plain", None), ("EAGLE-3 (eagle3)", str(tiny["eagle3"])), ("EAGLE-3 (other)", str(other))]
    assert all(r["identical_outputs"] == 2 for r in rows)
    assert mtbench.eagle3_labels(["a/head", "b/head", "c"]) == [
        ("EAGLE-3 (head #1)", "a/head"), ("EAGLE-3 (head #2)", "b/head"), ("EAGLE-3 (c)", "c")]
    assert mtbench.eagle3_labels(["a/head"]) == [("EAGLE-3", "a/head")]


def test_table_summary_and_plot(one_turn, capsys):
    rows = _rows(one_turn)
    width = max(len(r["method"]) for r in rows)
    header, line = mtbench.table_header(width), mtbench.table_line(rows[1], width)
    assert header.split(" | ")[0].strip() == "method" and len(header) == len(line)
    assert line.startswith("EAGLE-3") and "3/3" in line and f"{rows[1]['speedup']:.2f}x" in line
    text = mtbench.summary(rows)
    assert "\n" not in text and "bs=1" in text and "bs=2" in text
    assert "identical to plain: 12/12" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("matplotlib is not installed")
    assert (one_turn / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_prints_a_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    row = {"method": "plain", "batch_size": 1, "tok_s": 1.0, "model": "m", "device": "cpu"}
    mtbench.plot([row], str(tmp_path / "x.png"))
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "x.png").exists()


def test_second_turn_prompts_hold_the_first_answer(tiny):
    from specserve.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny["target"])
    questions = prompts.questions("mtbench", 2)
    first = mtbench.turn_prompts(tok, questions, [[], []], 0)
    assert first == [tok.encode_chat([{"role": "user", "content": q[0]}]) for q in questions]
    answers = [[tok.encode(text, add_special_tokens=False)] for text in (" Paris is the capital.", " Tokyo!")]
    second = mtbench.turn_prompts(tok, questions, answers, 1)
    for q, ans, one, two in zip(questions, answers, first, second):
        text = tok.decode(two, skip_special_tokens=False)
        assert text.startswith(tok.decode(one, skip_special_tokens=False))  # the first turn, then
        assert text.index(q[0]) < text.index(tok.decode(ans[0])) < text.index(q[1])  # its answer, then q2
        assert text.endswith("<|im_start|>assistant\n")
    assert len(prompts.questions("mtbench")) == 80 and all(len(q) == 2 for q in prompts.questions("mtbench"))


def test_two_turns(tiny, tmp_path):
    argv = _argv(tiny, tmp_path, "--ngram", "--no-hf", "--turns", "2", "--num-questions", "2",
                 "--max-new-tokens", "5", "--batch-sizes", "2")
    assert mtbench.main(argv) == 0
    rows = _rows(tmp_path)
    assert [r["method"] for r in rows] == ["plain", "NGRAM"]
    for r in rows:
        assert r["turns"] == 2 and r["identical_outputs"] == 2
        assert 4 <= r["tokens"] <= 2 * 2 * 5  # two questions, two answers each


def test_run_turns_feeds_each_answer_into_the_next_prompt(tiny):
    """The second turn's prompt holds the answer the same generator gave to the first."""
    from specserve.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny["target"])
    questions = prompts.questions("mtbench", 3)
    seen: list[list[list[int]]] = []

    def fake(prompts):  # answer i of a turn: the token ids of "answer-<turn>-<i>"
        seen.append(prompts)
        return 0.5, [tok.encode(f" answer-{len(seen)}-{i}", add_special_tokens=False)
                     for i in range(len(prompts))], (1, 2, 3)

    answers = mtbench.run_turns(fake, tok, questions, 2)
    assert answers.seconds == 1.0 and answers.requests == 6 and len(seen) == 2
    assert (answers.verifies, answers.accepted, answers.plain_steps) == (2, 4, 6)  # summed over the turns
    for i, prompt in enumerate(seen[1]):
        assert f"answer-1-{i}" in tok.decode(prompt) and "answer-2" not in tok.decode(prompt)
    assert [tok.decode(a[1]) for a in answers.ids] == [f" answer-2-{i}" for i in range(3)]


def test_transformers_rows(tiny, tmp_path):
    argv = _argv(tiny, tmp_path, "--num-questions", "2", "--max-new-tokens", "4", "--batch-sizes", "1,2")
    assert mtbench.main(argv) == 0
    rows = _rows(tmp_path)
    assert [(r["method"], r["batch_size"]) for r in rows] == [
        ("plain", 1), ("HF transformers", 1), ("plain", 2), ("HF transformers", 2)]
    for r in rows[1::2]:
        assert r["accept_length"] is None and r["algorithm"] is None and r["tok_s"] > 0
        # same prompt ids, same greedy answers: also at bs=2, where transformers left-pads
        assert r["identical_outputs"] == 2, r


def test_standalone_rows_on_humaneval(tiny, tmp_path):
    """--standalone-draft adds a STANDALONE row (a smaller model of the target's vocabulary
    drafting), lossless; --questions humaneval asks HumanEval's stubs, one turn each."""
    draft = save_tiny_hf("llama", tmp_path / "draft", vocab_size=tiny["vocab"], max_position_embeddings=2048,
                         num_hidden_layers=1, seed=3)
    argv = _argv(tiny, tmp_path, "--standalone-draft", str(draft), "--questions", "humaneval", "--no-hf",
                 "--num-questions", "3", "--max-new-tokens", "5", "--batch-sizes", "1,2",
                 "--spec-args", "speculative_adaptive=off")
    assert mtbench.main(argv) == 0
    rows = _rows(tmp_path)
    assert [(r["method"], r["batch_size"]) for r in rows] == [
        ("plain", 1), ("STANDALONE", 1), ("plain", 2), ("STANDALONE", 2)]
    for r in rows:
        assert r["questions"] == "humaneval" and r["num_questions"] == 3
        assert r["identical_outputs"] == 3 and r["identical_to_first_bs"] == 3, r
    assert rows[1]["algorithm"] == "STANDALONE" and rows[1]["draft"] == str(draft)
    assert mtbench.summary(rows).startswith("humaneval ")
    torch.save(list(range(0, tiny["vocab"], 2)), tmp_path / "half.pt")  # FR-Spec: every other token
    fr = tmp_path / "fr"
    fr.mkdir()
    argv = _argv(tiny, fr, "--standalone-draft", str(draft), "--standalone-token-map", str(tmp_path / "half.pt"),
                 "--questions", "humaneval", "--no-hf", "--num-questions", "2", "--max-new-tokens", "5",
                 "--batch-sizes", "1", "--spec-args", "speculative_adaptive=off")
    assert mtbench.main(argv) == 0
    rows = _rows(fr)
    assert [r["method"] for r in rows] == ["plain", "STANDALONE", "STANDALONE (FR-Spec)"]
    assert all(r["identical_outputs"] == 2 for r in rows), rows
    with pytest.raises(ValueError, match="needs --standalone-draft"):
        mtbench.main(_argv(tiny, tmp_path, "--standalone-token-map", str(tmp_path / "half.pt"), "--no-hf"))
    with pytest.raises(ValueError, match="one turn each"):
        mtbench.main(_argv(tiny, tmp_path, "--questions", "humaneval", "--turns", "2", "--no-hf"))


def test_question_sets():
    """HumanEval's 164 stubs, each asked as one chat turn holding the stub whole; every
    MT-bench turn and every stub is what training data may never hold."""
    from specserve.bench.prompts import HUMANEVAL, benchmark_turns

    humaneval = prompts.questions("humaneval")
    assert len(humaneval) == 164 and all(len(q) == 1 for q in humaneval)
    first = json.loads(HUMANEVAL.read_text().splitlines()[0])
    assert first["task_id"] == "HumanEval/0" and first["prompt"] in humaneval[0][0]
    assert humaneval[0][0].startswith("Complete the following Python function")
    assert prompts.questions("humaneval", 2) == humaneval[:2]
    turns = benchmark_turns()
    assert len(turns) == 80 * 2 + 164 and first["prompt"] in turns
    with pytest.raises(ValueError, match="unknown question set"):
        prompts.questions("gsm8k")


def test_bad_draft_fails_loudly(tiny, tmp_path):
    with pytest.raises(ValueError, match="EAGLE-3: no draft model path"):
        mtbench.main(_argv(tiny, tmp_path, "--eagle3-draft", "", "--no-hf", "--num-questions", "1"))
    with pytest.raises(RuntimeError, match="the EAGLE-2 engine failed to start"):
        mtbench.main(_argv(tiny, tmp_path, "--eagle-draft", str(tmp_path), "--no-hf", "--num-questions", "1",
                           "--max-new-tokens", "2", "--batch-sizes", "1"))
    with pytest.raises(ValueError, match="no draft model path"):
        mtbench.engine_kwargs(mtbench._parser().parse_args([]), mtbench.Method("EAGLE-3", "EAGLE3", None))


def test_registered_with_specserve_bench(capsys):
    from specserve.bench import cli

    assert cli.BENCHES["mtbench"][0] == "specserve.bench.mtbench"
    assert cli.main([]) == 2
    assert "mtbench" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["mtbench", "--help"])
    assert e.value.code == 0
    assert "--eagle3-draft" in capsys.readouterr().out
