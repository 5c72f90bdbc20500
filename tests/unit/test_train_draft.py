"""`specserve train-draft`: EAGLE-3 / EAGLE-2 heads distilled from a tiny target, on CPU.

* The training forward is the inference forward: TTT step 0 equals the head's extend,
  and step j at index i equals the j-th chain-drafting forward rooted at position i
  (positions, attention over the prefix + the chain's own keys) -- through the same
  module and through the written checkpoint loaded by `load_draft`.
* End to end on a tiny target (its own 512-token word tokenizer, so nothing is fetched;
  its final norm scaled up so its greedy choices are confident): regenerate answers with
  the Engine, train, and the written head loads, drafts losslessly, and is accepted far
  more often than a random head of the same layout.
* The draft vocabulary / d2t / t2d, resuming, --init-from and --time-limit (the prompt
  filters and the CLI's flags: test_train_cli.py).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specserve import Engine
from specserve.attention.torch_ref import TorchRefBackend
from specserve.cache.kv_pool import KVPool
from specserve.cache.req_table import ReqToTokenTable
from specserve.cli import main as specserve_main
from specserve.core.forward_batch import ForwardBatch, ForwardMode
from specserve.models.draft_layouts import read_tensors, save_eagle2, save_eagle3
from specserve.models.draft_loader import load_draft
from specserve.models.loader import load_model, read_hf_config
from specserve.spec.eagle import LAYOUTS
from specserve.train import trainer
from specserve.train.batching import split_validation
from specserve.train.cli import build_parser, config_from_args
from specserve.train.draft import EAGLE2, EAGLE3, build_draft, default_aux_layers, head_config, save_head, unroll
from specserve.train.features import Teacher
from specserve.train.loss import answer_rows
from specserve.train.regen import RegenConfig, load_sequences, regenerate
from specserve.train.trainer import TrainConfig, train_draft
from specserve.train.vocab import answer_token_counts, build_draft_vocab
from tests.unit.train_utils import VOCAB, make_tiny

CPU, F32 = torch.device("cpu"), torch.float32
GREEDY = {"temperature": 0, "max_new_tokens": 24}
# the governor stays off: these tests compare acceptance, which timed plain steps would thin out
SPEC = {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4,
        "speculative_adaptive": "off"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("train_draft"))


def _config(tiny, out: Path, algorithm: str = EAGLE3, **kw) -> TrainConfig:
    _, target, data = tiny
    base = dict(model=str(target), algorithm=algorithm, output=out, dataset=str(data), num_prompts=8,
                max_new_tokens=24, max_seq_len=128, draft_vocab_size=128, ttt_steps=3, max_steps=80,
                lr=3e-3, batch_tokens=2048, device="cpu", save_every=1000)
    return TrainConfig(**(base | kw))


def _copy_answers(src: Path, dst: Path) -> Path:
    """Reuse a run's regenerated answers (they do not depend on the algorithm)."""
    dst.mkdir(parents=True)
    for name in ("regen.json", "prompts.jsonl"):
        shutil.copy(src / name, dst / name)
    shutil.copytree(src / "shards", dst / "shards")
    return dst


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def eagle3_run(tiny):
    root, target, _ = tiny
    out = root / "eagle3"
    result = train_draft(_config(tiny, out))
    prompts = [json.loads(line)["ids"] for line in (out / "prompts.jsonl").read_text().splitlines()]
    plain = Engine(str(target), device="cpu", log_level="warning").generate(input_ids=prompts,
                                                                              sampling_params=GREEDY)
    return out, result, prompts, [o["output_ids"] for o in plain]


def _drafted(target: Path, algorithm: str, head: Path, prompts: list[list[int]]) -> tuple[list, list[float]]:
    engine = Engine(str(target), device="cpu", log_level="warning", speculative_algorithm=algorithm,
                    speculative_draft_model_path=str(head), **SPEC)
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    return [o["output_ids"] for o in outs], [o["meta_info"]["spec_accept_length"] for o in outs]


# -- the training forward is the inference forward ------------------------------------------

def _head(target_dir: Path, algorithm: str, seed: int = 1):
    """A head with every parameter perturbed (so a misplaced tensor shows), and its parts."""
    target = load_model(target_dir, F32, CPU)
    counts = torch.bincount(torch.arange(VOCAB) % 97, minlength=VOCAB)
    vocab = build_draft_vocab(counts, 128, [2]) if algorithm == EAGLE3 else None
    aux = default_aux_layers(target.config.num_layers) if algorithm == EAGLE3 else ()
    cfg = head_config(read_hf_config(target_dir), algorithm, vocab, aux, torch.float32)
    draft = build_draft(cfg, algorithm, target, vocab, aux, 256, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    teacher = Teacher(target, "aux" if algorithm == EAGLE3 else "final", aux,
                      vocab.ids if vocab is not None else None)
    return target, draft, vocab, cfg, teacher


class _DraftRunner:
    """The draft's inference forward on one request row, with its own KV pool."""

    def __init__(self, draft) -> None:
        c = draft.config
        self.draft, self.used = draft, 0
        self.pool = KVPool(256, c.num_layers, c.num_kv_heads, c.head_dim, F32, CPU)
        self.table = ReqToTokenTable(1, 256, CPU)
        self.backend = TorchRefBackend()

    @torch.no_grad()
    def __call__(self, tokens: list[int], hidden: torch.Tensor, positions: list[int]) -> tuple[torch.Tensor, ...]:
        n = len(tokens)
        slots = torch.arange(1 + self.used, 1 + self.used + n)
        self.table.write(0, self.used, slots)
        mode = ForwardMode.DECODE if self.used else ForwardMode.DRAFT_EXTEND
        fb = ForwardBatch(mode, torch.tensor(tokens), torch.tensor(positions), slots, torch.tensor([0]),
                          [self.used], [n], self.table.table, self.pool, self.backend)
        self.used += n
        self.backend.init_forward_metadata(fb)
        h_logits, h_next = self.draft(fb, hidden)
        return h_logits, h_next, self.draft.compute_logits(h_logits)


def _sequence(n: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("algorithm", [EAGLE3, EAGLE2])
def test_step0_equals_the_inference_forward(tiny, tmp_path, algorithm):
    _, target_dir, _ = tiny
    target, draft, vocab, cfg, teacher = _head(target_dir, algorithm)
    ids = _sequence()
    n = ids.shape[1]
    taught = teacher(ids, torch.tensor([n]), answer_rows(torch.tensor([n]), torch.tensor([4]), n))
    with torch.no_grad():
        h_logits, h_next = unroll(draft, taught.features, ids, steps=1)[0]
        logits = draft.compute_logits(h_logits[0])
    # draft position p consumes (feature p, token p + 1): the extend over positions 0..n-2
    ref = _DraftRunner(draft)(ids[0, 1:].tolist(), taught.features[0, :n - 1], list(range(n - 1)))
    torch.testing.assert_close(h_logits[0, :n - 1], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h_next[0, :n - 1], ref[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[:n - 1], ref[2], rtol=1e-5, atol=1e-5)
    # the same through the written checkpoint, as the engine loads it
    save_head(tmp_path / "head", draft, vocab, cfg, torch.float32)
    loaded = load_draft(tmp_path / "head", target, LAYOUTS[algorithm], F32, CPU)
    assert loaded.aux_layers == draft.aux_layers
    ref2 = _DraftRunner(loaded)(ids[0, 1:].tolist(), taught.features[0, :n - 1], list(range(n - 1)))
    torch.testing.assert_close(logits[:n - 1], ref2[2], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("algorithm", [EAGLE3, EAGLE2])
def test_ttt_steps_equal_chain_drafting(tiny, algorithm):
    """Step j at index i == the depth-j draft forward of a chain rooted at position i:
    token i+1+j at position i+j, the previous depth's hidden, attention over the
    true-feature draft KV of positions <= i plus the chain's own earlier depths."""
    _, target_dir, _ = tiny
    _, draft, _, _, teacher = _head(target_dir, algorithm, seed=2)
    ids, steps = _sequence(16, seed=3), 4
    n = ids.shape[1]
    taught = teacher(ids, torch.tensor([n]), answer_rows(torch.tensor([n]), torch.tensor([2]), n))
    with torch.no_grad():
        outs = unroll(draft, taught.features, ids, steps)
    tokens = ids[0].tolist()
    for root in (0, 5, n - 2 - steps):
        run = _DraftRunner(draft)
        h_logits, hidden, _ = run(tokens[1:root + 2], taught.features[0, :root + 1], list(range(root + 1)))
        torch.testing.assert_close(outs[0][0][0, root], h_logits[-1], rtol=1e-5, atol=1e-5)
        hidden = hidden[-1:]
        for j in range(1, steps):
            h_logits, hidden, _ = run([tokens[root + 1 + j]], hidden, [root + j])
            torch.testing.assert_close(outs[j][0][0, root], h_logits[0], rtol=1e-5, atol=1e-5, msg=f"step {j}")
            torch.testing.assert_close(outs[j][1][0, root], hidden[0], rtol=1e-5, atol=1e-5)


def test_teacher_pads_batches_exactly(tiny):
    """Features and distributions of a padded batch equal each sequence's own forward."""
    _, target_dir, _ = tiny
    _, _, vocab, _, teacher = _head(target_dir, EAGLE3)
    seqs = [_sequence(9, seed=4)[0], _sequence(14, seed=5)[0]]
    ids = torch.zeros(2, 14, dtype=torch.int64)
    for b, s in enumerate(seqs):
        ids[b, :s.numel()] = s
    lengths, prompts = torch.tensor([9, 14]), torch.tensor([3, 5])
    both = teacher(ids, lengths, answer_rows(lengths, prompts, 14))
    for b, s in enumerate(seqs):
        n = s.numel()
        one = teacher(s[None], torch.tensor([n]), answer_rows(torch.tensor([n]), prompts[b:b + 1], n))
        torch.testing.assert_close(both.features[b, :n], one.features[0], rtol=1e-5, atol=1e-5)
        assert not both.features[b, n:].any()
        rows = both.row_index[b][both.row_index[b] >= 0]
        torch.testing.assert_close(both.probs[rows], one.probs, rtol=1e-5, atol=1e-6)
        assert torch.equal(both.top[rows], one.top)
    assert both.probs.shape[-1] == vocab.size


# -- end to end --------------------------------------------------------------------------------

def test_eagle3_head_trains_loads_and_is_accepted(tiny, eagle3_run, tmp_path):
    _, target, _ = tiny
    out, result, prompts, plain = eagle3_run
    log = _log(out)
    assert [r["step"] for r in log] == list(range(1, 81))
    first, last = log[0], log[-1]
    assert last["loss"] < 0.5 * first["loss"], (first["loss"], last["loss"])
    assert min(last["acc_j"]) > 0.6 > max(first["acc_j"]), (first["acc_j"], last["acc_j"])
    assert result.steps == 80 and len(result.acc) == 3
    # the published layout, exactly: the names, shapes and dtypes of save_eagle3's heads
    reference = read_tensors(save_eagle3(tmp_path / "random", target, draft_vocab=128))
    written = read_tensors(out)
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in reference.items()}
    assert written["d2t"].dtype == torch.int64 and written["t2d"].dtype == torch.bool
    assert written["fc.weight"].dtype == torch.bfloat16
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 128
    # lossless, and accepted far more often than a random head of the same layout
    drafted, trained = _drafted(target, "EAGLE3", out, prompts)
    assert drafted == plain
    _, random_head = _drafted(target, "EAGLE3", tmp_path / "random", prompts)
    assert sum(trained) / len(trained) > 2.5 > 1.5 > sum(random_head) / len(random_head), (trained, random_head)


def test_eagle3_vocab_is_the_answers_most_frequent_tokens(tiny, eagle3_run):
    _, target, _ = tiny
    out, result, _, _ = eagle3_run
    seqs = load_sequences(out)
    counts = answer_token_counts(seqs, VOCAB)
    d2t = read_tensors(out)["d2t"]
    ids = d2t + torch.arange(d2t.numel())
    assert torch.equal(ids, build_draft_vocab(counts, 128, [2]).ids)
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(ids.tolist())  # every answer token
    assert result.vocab_coverage == 1.0
    loaded = load_draft(out, load_model(target, F32, CPU), LAYOUTS["EAGLE3"], F32, CPU)
    assert torch.equal(loaded.token_map, ids)
    assert torch.equal(read_tensors(out)["t2d"].nonzero().flatten(), ids)


def test_draft_vocab_ranks_by_frequency():
    counts = torch.tensor([0, 5, 9, 5, 0, 1, 7, 0])
    vocab = build_draft_vocab(counts, 4, always=[7])  # 7 (EOS) forced in despite a zero count
    assert vocab.ids.tolist() == [1, 2, 6, 7]  # 2 (9), 6 (7), then 1 beats 3 on the tie (lower id)
    assert (vocab.d2t + torch.arange(4)).tolist() == vocab.ids.tolist()
    assert vocab.t2d.nonzero().flatten().tolist() == [1, 2, 6, 7]
    assert build_draft_vocab(counts, 100).ids.tolist() == list(range(8))  # capped at V, zeros fill
    assert vocab.coverage(counts) == pytest.approx(21 / 27)


def test_eagle2_head_trains_loads_and_drafts_losslessly(tiny, eagle3_run, tmp_path):
    _, target, _ = tiny
    out = _copy_answers(eagle3_run[0], tmp_path / "eagle2")
    result = train_draft(_config(tiny, out, EAGLE2, draft_vocab_size=None, max_steps=40, ttt_steps=2,
                                 val_size=1))
    log = _log(out)
    assert log[-1]["loss"] < 0.7 * log[0]["loss"] and log[-1]["acc_j"][0] > log[0]["acc_j"][0]
    assert result.vocab_coverage is None
    val = [json.loads(line) for line in (out / trainer.VAL_LOG).read_text().splitlines()]
    assert [r["step"] for r in val] == [40] and len(result.val_acc) == 2
    # one batch holds the 7 training answers; the 8th is scored only in validation
    answers = sum(s.answer_len for s in load_sequences(out))
    assert all(r["rows_j"][0] + val[0]["val_rows"] == answers for r in log) and val[0]["val_rows"] > 0
    reference = read_tensors(save_eagle2(tmp_path / "random", target, bias=True))
    assert {k: v.shape for k, v in read_tensors(out).items()} == {k: v.shape for k, v in reference.items()}
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]
    drafted, accept = _drafted(target, "EAGLE", out, eagle3_run[2])
    assert drafted == eagle3_run[3]
    assert sum(accept) / len(accept) > 1.8, accept


# -- resuming and re-running -------------------------------------------------------------------

class _Interrupted(Exception):
    pass


def test_resume_continues_exactly_from_the_saved_step(tiny, eagle3_run, tmp_path, monkeypatch):
    straight = _copy_answers(eagle3_run[0], tmp_path / "straight")
    cut = _copy_answers(eagle3_run[0], tmp_path / "cut")
    monkeypatch.setattr(trainer, "_engine", lambda *a: pytest.fail("answers exist: no engine needed"))
    train_draft(_config(tiny, straight, max_steps=6, save_every=2))
    real_step, calls = trainer.train_step, []

    def stop_at_fifth(run, batch):
        calls.append(1)
        if len(calls) == 5:
            raise _Interrupted
        return real_step(run, batch)

    monkeypatch.setattr(trainer, "train_step", stop_at_fifth)
    with pytest.raises(_Interrupted):
        train_draft(_config(tiny, cut, max_steps=6, save_every=2))
    assert torch.load(cut / trainer.STATE, weights_only=True)["step"] == 4  # the last save
    monkeypatch.setattr(trainer, "train_step", real_step)
    with pytest.raises(ValueError, match="--resume"):
        train_draft(_config(tiny, cut, max_steps=6, save_every=2))
    with pytest.raises(ValueError, match="ttt_steps"):
        train_draft(_config(tiny, cut, max_steps=6, save_every=2, ttt_steps=2, resume=True))
    result = train_draft(_config(tiny, cut, max_steps=6, save_every=2, resume=True))
    assert result.steps == 6
    a, b = _log(straight), _log(cut)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in b] == [r["loss"] for r in a]  # resumed steps equal uninterrupted ones
    for name, tensor in read_tensors(straight).items():
        assert torch.equal(tensor, read_tensors(cut)[name]), name


def test_time_limit_saves_and_a_resume_finishes(tiny, eagle3_run, tmp_path, monkeypatch):
    out = _copy_answers(eagle3_run[0], tmp_path / "timed")
    monkeypatch.setattr(trainer, "_engine", lambda *a: pytest.fail("answers exist: no engine needed"))
    cut = train_draft(_config(tiny, out, max_steps=4, save_every=100, time_limit=1e-9))
    assert cut.steps == 0 and torch.load(out / trainer.STATE, weights_only=True)["step"] == 0
    assert (out / "model.safetensors").is_file()  # the head is written when time is up
    done = train_draft(_config(tiny, out, max_steps=4, save_every=100, resume=True))
    assert done.steps == 4 and [r["step"] for r in _log(out)] == [1, 2, 3, 4]


def test_time_limit_during_regeneration_keeps_shards_and_resume_goes_on(tiny, tmp_path, capsys):
    _, target, data = tiny
    out = tmp_path / "regen_cut"
    args = ["train-draft", "--model", str(target), "--output", str(out), "--dataset", str(data),
            "--num-prompts", "8", "--max-new-tokens", "8", "--max-seq-len", "128", "--shard-size", "4",
            "--draft-vocab-size", "64", "--ttt-steps", "2", "--max-steps", "1", "--batch-tokens", "2048",
            "--device", "cpu"]
    assert specserve_main(args + ["--time-limit", "1e-9"]) == 0
    assert "0 of 2 shards made; continue with --resume" in capsys.readouterr().out
    assert (out / "regen.json").is_file() and not list((out / "shards").glob("*.pt"))
    assert specserve_main(args + ["--resume"]) == 0
    assert "after 1 steps" in capsys.readouterr().out and len(load_sequences(out)) == 8


def test_init_from_a_head_starts_from_its_weights_vocabulary_and_trees(tiny, eagle3_run, tmp_path, monkeypatch):
    """`--init-from` a trained head: before any step the written head is that head (every
    tensor, the draft vocabulary, its specserve_* config keys), and training goes on from
    its loss, not a fresh head's."""
    start = tmp_path / "start"
    shutil.copytree(eagle3_run[0], start, ignore=shutil.ignore_patterns("shards", "*.pt", "*.jsonl", "regen.json"))
    config = json.loads((start / "config.json").read_text())
    (start / "config.json").write_text(json.dumps(config | {"specserve_default_tree": [2, 2, 3]}))
    monkeypatch.setattr(trainer, "_engine", lambda *a: pytest.fail("answers exist: no engine needed"))
    out = _copy_answers(eagle3_run[0], tmp_path / "tuned")
    first = train_draft(_config(tiny, out, max_steps=3, time_limit=1e-9, init_from=str(start), val_size=2))
    assert first.steps == 0
    written, wanted = read_tensors(out), read_tensors(start)
    assert written.keys() == wanted.keys()
    for name, tensor in wanted.items():
        assert torch.equal(written[name], tensor), name
    assert json.loads((out / "config.json").read_text())["specserve_default_tree"] == [2, 2, 3]
    train_draft(_config(tiny, out, max_steps=3, init_from=str(start), val_size=2, resume=True))
    val = [json.loads(line)["step"] for line in (out / trainer.VAL_LOG).read_text().splitlines()]
    assert val == [0, 3]  # the starting head is scored once, before its first step
    fresh = _log(eagle3_run[0])[0]["loss"]
    assert _log(out)[0]["loss"] < 0.5 * fresh, (_log(out)[0]["loss"], fresh)


def test_init_from_refuses_another_vocabulary_size_or_a_missing_head(tiny, tmp_path):
    _, target, data = tiny
    base = ["--model", str(target), "--output", str(tmp_path / "o"), "--dataset", str(data)]
    with pytest.raises(ValueError, match="vocabulary is kept"):
        config_from_args(build_parser().parse_args(base + ["--init-from", str(tmp_path), "--draft-vocab-size", "64"]))
    with pytest.raises(ValueError, match="no head there"):
        config_from_args(build_parser().parse_args(base + ["--init-from", str(tmp_path / "none")]))


def test_other_settings_in_the_same_output_are_refused(tiny, eagle3_run, tmp_path):
    out = _copy_answers(eagle3_run[0], tmp_path / "other")
    with pytest.raises(ValueError, match="max_new_tokens"):
        train_draft(_config(tiny, out, max_new_tokens=12))


def test_extra_temperatures_add_seeded_sampled_answers(tiny, eagle3_run, tmp_path, monkeypatch):
    """Each prompt's first answer is the greedy one a plain run makes; one more per extra
    temperature is sampled with its own seed (the same on a rerun); a held-out split keeps
    a prompt's answers together."""
    _, target, data = tiny
    cfg = RegenConfig(str(target), str(data), 8, 24, 128, extra_temperatures=(50.0,))
    make = lambda: Engine(str(target), device="cpu", log_level="warning")  # noqa: E731
    regenerate(tmp_path / "a", cfg, make)
    regenerate(tmp_path / "b", cfg, make)
    seqs, greedy = load_sequences(tmp_path / "a"), load_sequences(eagle3_run[0])
    assert len(seqs) == 16 and [s.ids.tolist() for s in seqs[:8]] == [s.ids.tolist() for s in greedy]
    assert [s.ids[:s.prompt_len].tolist() for s in seqs[8:]] == [s.ids[:s.prompt_len].tolist() for s in greedy]
    sampled = sum(a.ids.tolist() != b.ids.tolist() for a, b in zip(seqs[8:], greedy))
    assert sampled >= 6, sampled
    assert [s.ids.tolist() for s in load_sequences(tmp_path / "b")] == [s.ids.tolist() for s in seqs]
    train, held = split_validation(seqs, 3, seed=0)
    prompt = lambda s: tuple(s.ids[:s.prompt_len].tolist())  # noqa: E731
    assert len(held) == 4 and not {prompt(s) for s in held} & {prompt(s) for s in train}
    # a directory made before extra temperatures existed is still the same settings
    old = _copy_answers(eagle3_run[0], tmp_path / "old")
    meta = json.loads((old / "regen.json").read_text())
    del meta["extra_temperatures"]
    (old / "regen.json").write_text(json.dumps(meta))
    monkeypatch.setattr(trainer, "_engine", lambda *a: pytest.fail("answers exist: no engine needed"))
    assert train_draft(_config(tiny, old, max_steps=1)).steps == 1
    with pytest.raises(ValueError, match="extra_temperatures"):
        regenerate(old, cfg, make)  # extra answers into a greedy-only directory
    with pytest.raises(ValueError, match="turns: 'first' there, 'all' now"):
        regenerate(old, RegenConfig(str(target), str(data), 8, 24, 128, turns="all"), make)
