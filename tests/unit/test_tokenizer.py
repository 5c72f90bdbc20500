"""Runtime tokenizer: ids and chat template against transformers on the real SmolLM2 GGUF,
pre-tokenizer families on a tiny synthetic vocabulary, the streaming detokenizer (property
test: concatenated deltas == full decode) and stop-string hold-back.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.models.gguf import convert_gguf
from specserve.tokenizer.streaming import IncrementalDetokenizer, StopChecker
from specserve.tokenizer.tokenizer import CHATML_TEMPLATE, Tokenizer
from tests.unit.test_gguf import tiny_model, tiny_vocab, write_tiny_gguf

TEXTS = [
    "Hello world!", "def f(x):\n    return x**2  # square\n\n\n", "naïve café 日本語 🤖🎉 ü",
    "12345 3.14159 1,000,000", "  leading and trailing   ", "\t\ttabs\n\r\nCRLF", "I'm we'll they'D",
    "<|im_start|>user\nHi<|im_end|>\n", "a<|endoftext|>b", "emoji 👨‍👩‍👧 family", "Ωmega ∑ → ←",
    "version 2.0.1-beta", "x" * 40, "", " ", "\n\n\n", "The year 2024.",
]


# ---- the real SmolLM2 vocabulary against transformers -------------------------------------

@pytest.fixture(scope="module")
def smol(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def hf_tok(smollm2_gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.mark.slow
def test_smollm2_ids_match_transformers(smol: Tokenizer, hf_tok, smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    from_dir = AutoTokenizer.from_pretrained(smollm2_dir)  # our tokenizer.json, loaded by HF
    for text in TEXTS:
        ids = smol.encode(text)
        assert ids == hf_tok(text).input_ids == from_dir(text).input_ids, text
        assert smol.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids) == text
    assert smol.encode("<|im_start|>") == [1] and smol.decode([1, 28, 2]) == ","
    # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer.json) splits every digit
    # off first; transformers' GGUF loader uses plain GPT-2 splitting, which differs only on
    # whitespace runs before a digit: "a  1" -> a|ĠĠ|1 (ours) vs a|Ġ|Ġ|1 (transformers).
    assert smol.encode("a  1") == [81, 256, 33]


@pytest.mark.slow
def test_smollm2_chat_template_and_special_ids(smol: Tokenizer, hf_tok) -> None:
    for messages in ([{"role": "user", "content": "Hi there"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}, {"role": "user", "content": "ok"}]):
        text = smol.apply_chat_template(messages)
        assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert smol.encode_chat(messages) == hf_tok(text).input_ids
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    assert smol.apply_chat_template(parts) == smol.apply_chat_template([{"role": "user", "content": "Hi\nthere"}])
    assert smol.eos_token_ids == frozenset({2, 0}) and smol.bos_token_id == 1 and not smol.add_bos_token
    assert smol.vocab_size == 49152 and smol.token_str(2) == "<|im_end|>" and smol.token_str(28) == ","


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(text=st.text(max_size=30), extra=st.lists(st.integers(0, 49151), max_size=8), data=st.data())
def test_smollm2_detokenizer_matches_full_decode(smol: Tokenizer, text: str, extra: list[int], data) -> None:
    ids = smol.encode(text) + extra
    for skip in (True, False):
        _check_stream(smol, ids, skip, data)


# ---- synthetic vocabularies: every pre-tokenizer family, BOS policy, templates ------------

def _tiny(tmp_path: Path, pre: str = "smollm", **kw) -> Tokenizer:
    write_tiny_gguf(tmp_path / "t.gguf", tiny_model("llama"), "llama", pre=pre, **kw)
    convert_gguf(tmp_path / "t.gguf", tmp_path / pre)
    return Tokenizer.from_dir(tmp_path / pre)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tokenizer:
    return _tiny(tmp_path_factory.mktemp("tiny"))


def test_pre_tokenizer_families(tmp_path: Path) -> None:
    tokens = tiny_vocab()[0]
    tid = {t: i for i, t in enumerate(tokens)}
    digits = _tiny(tmp_path, "smollm")  # \p{N} split first: the "1 2" merge can never apply
    assert digits.encode("x12 the") == [tid["x"], tid["1"], tid["2"], tid["Ġthe"]]
    gpt2 = _tiny(tmp_path, "gpt2")
    assert gpt2.encode("x12") == [tid["x"], tid["12"]]
    llama3 = _tiny(tmp_path, "llama-bpe", add_bos=True)  # \p{N}{1,3}, BOS added
    assert llama3.encode("1212") == [1, tid["12"], tid["1"], tid["2"]]
    qwen2 = _tiny(tmp_path, "qwen2")  # one digit at a time, NFC-normalized
    assert qwen2.encode("12") == [tid["1"], tid["2"]]
    assert qwen2.encode("e\u0301") == qwen2.encode("\u00e9") != gpt2.encode("e\u0301")
    for tok in (digits, gpt2, llama3, qwen2):
        ids = tok.encode("<|im_start|>in <tool>  the<|im_end|>", add_special_tokens=False)
        assert ids[0] == 1 and ids[-1] == 2 and tid["<tool>"] in ids
        assert tok.decode(ids) == "in <tool>  the"  # control tokens skipped, user-defined kept


def test_bos_never_duplicated(tmp_path: Path) -> None:
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tok = _tiny(tmp_path, "llama-bpe", add_bos=True, chat_template=template)
    assert tok.add_bos_token and tok.bos_token_id == 1
    assert tok.encode("the") == [1, *tok.encode("the", add_special_tokens=False)]
    assert tok.encode("<|im_start|>the") == tok.encode("<|im_start|>the", add_special_tokens=False)
    ids = tok.encode_chat([{"role": "user", "content": "in"}])
    assert ids[0] == 1 and ids[1] != 1


def test_fallback_chatml_and_validation(tiny: Tokenizer) -> None:
    assert tiny.chat_template == CHATML_TEMPLATE  # the tiny GGUF has no template
    msgs = [{"role": "user", "content": "hi"}]
    assert tiny.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny.apply_chat_template(msgs, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    for bad, why in [([], "non-empty list"), ([{"content": "x"}], r"messages\[0\]\.role"),
                     ([{"role": "user"}], "got missing"), ([{"role": "user", "content": 3}], "got a int"),
                     ([{"role": "user", "content": [{"type": "image_url"}]}], "only text"), (["hi"], "object")]:
        with pytest.raises(ValueError, match=why):
            tiny.apply_chat_template(bad)
    tool_call = [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    assert "assistant" in tiny.apply_chat_template(tool_call)


def test_template_helpers(tiny: Tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(tiny, "chat_template", "{{ messages[0]['content'] | tojson }}{{ strftime_now('%Y')[:2] }}"
                        "{% if messages|length > 1 %}{{ raise_exception('only one message') }}{% endif %}")
    assert tiny.apply_chat_template([{"role": "user", "content": "日本 <b>"}]) == '"日本 <b>"20'
    with pytest.raises(ValueError, match="only one message"):
        tiny.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    monkeypatch.setattr(tiny, "chat_template", "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="chat template failed"):
        tiny.apply_chat_template([{"role": "user", "content": "a"}])


def test_from_dir_reads_hf_style_files(tmp_path: Path, tiny: Tokenizer) -> None:
    tiny._tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|im_end|>"}, "bos_token": "<|im_start|>",
         "chat_template": [{"name": "default", "template": "{{ eos_token }}"}, {"name": "tool_use", "template": "x"}]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == frozenset({0, 2}) and tok.bos_token_id == 1 and not tok.add_bos_token
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_end|>"
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path / "nope")


# ---- incremental detokenizer ---------------------------------------------------------------

def _check_stream(tok: Tokenizer, ids: list[int], skip: bool, data) -> None:
    detok, out, i = IncrementalDetokenizer(tok, skip), [], 0
    while i < len(ids):
        n = data.draw(st.integers(1, 4))
        delta = detok.push(ids[i:i + n])
        assert not delta.endswith("\ufffd")  # a partial character is never released
        out.append(delta)
        i += n
    out.append(detok.flush())
    assert "".join(out) == tok.decode(ids, skip)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 266), max_size=24), data=st.data())
def test_detokenizer_matches_full_decode(tiny: Tokenizer, ids: list[int], data) -> None:
    # tiny's vocabulary is mostly single bytes: random ids make split and invalid UTF-8 galore
    for skip in (True, False):
        _check_stream(tiny, ids, skip, data)


def test_detokenizer_waits_for_whole_characters(tiny: Tokenizer) -> None:
    byte_ids = tiny.encode("é🤖", add_special_tokens=False)  # 2 + 4 single-byte tokens
    assert len(byte_ids) == 6
    detok = IncrementalDetokenizer(tiny)
    assert [detok.push([i]) for i in byte_ids] == ["", "é", "", "", "", "🤖"]
    assert detok.push([1]) == "" and detok.push(tiny.encode("the", add_special_tokens=False)) == "the"


# ---- stop strings ----------------------------------------------------------------------------

def _stream(stops: list[str], deltas: list[str]) -> tuple[str, str | None]:
    checker, out = StopChecker(stops), []
    for d in deltas:
        text, matched = checker.push(d)
        out.append(text)
        if matched is not None:
            return "".join(out), matched
    return "".join(out) + checker.flush(), None


def test_stop_split_across_deltas_and_no_false_holds() -> None:
    assert _stream(["###"], ["a#", "#", "#b"]) == ("a", "###")
    assert _stream(["###"], ["a#", "#", "b"]) == ("a##b", None)
    checker = StopChecker(["STOP"])
    assert checker.push("hello ") == ("hello ", None)  # nothing held: no stop starts with " "
    assert checker.push("ST") == ("", None) and checker.push("OR") == ("STOR", None)
    assert checker.push("S") == ("", None) and checker.flush() == "S"
    assert StopChecker([]).push("abc") == ("abc", None) and StopChecker([""]).push("abc") == ("abc", None)


def test_stop_overlapping_candidates() -> None:
    assert _stream(["abcd", "bc"], ["a", "b", "c", "d"]) == ("a", "bc")  # the one completed first
    assert _stream(["abcd", "bc"], ["abcd"]) == ("a", "bc")
    assert _stream(["ab", "abc"], ["ab"]) == ("", "ab")
    assert _stream(["aab"], ["a", "a", "a", "b"]) == ("a", "aab")  # held "aa" -> "aaa" keeps "aa"
    checker = StopChecker(["x"])
    assert checker.push("1x2") == ("1", "x") and checker.push("more") == ("", None)


@settings(max_examples=300, deadline=None)
@given(text=st.text("abc#", max_size=20), stops=st.lists(st.text("abc#", min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 20), max_size=6))
def test_stop_result_independent_of_chunking(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    whole = _stream(stops, [text])
    assert _stream(stops, deltas) == whole == _stream(stops, list(text) or [""])
    released, matched = whole
    if matched is None:
        assert released == text
    else:
        assert text.startswith(released + matched) and not any(s in released + matched[:-1] for s in stops)
