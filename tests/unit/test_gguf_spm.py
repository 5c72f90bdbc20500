"""A GGUF's SentencePiece vocabulary (`tokenizer.ggml.model` "llama": Llama 1/2, Mistral,
TinyLlama) tokenizes as llama.cpp does (models/gguf_tokenizer.py `_spm`), checked against a
plain Python transcription of llama.cpp's algorithm on a synthetic vocabulary: spaces as
"▁" with one prepended to each stretch of text between special tokens, the adjacent pair
whose joined piece scores highest merged first, characters outside the vocabulary as their
UTF-8 bytes' <0xXX> tokens. Every piece has its own score, as in SentencePiece's BPE
vocabularies (ties between different pairs: `_spm`'s docstring)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from specserve.models.gguf_tokenizer import build_tokenizer, tokenizer_config

SPACE = "\u2581"
CHARS = [SPACE, "a", "b", "e", "h", "i", "n", "t", "r", "s", "g", "é", ".", "!"]
# Joined pieces, best score first; some only reachable through others ("▁the" via "▁t" + "he")
JOINED = ["he", f"{SPACE}t", "in", f"{SPACE}the", "th", "er", f"{SPACE}a", "an", "ing", f"{SPACE}in",
          "ee", "e" + SPACE, "at", "ab", "ba", "aba", "bab", "ss", "sss", "é" + "t", "ti", "tin", "ting"]
SPECIALS = ["<unk>", "<s>", "</s>"]


def _meta(add_space_prefix: bool = True) -> dict:
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + CHARS + JOINED
    types = [2, 3, 3] + [6] * 256 + [1] * (len(CHARS) + len(JOINED))
    scores = [0.0] * (3 + 256) + [-1000.0 - i for i in range(len(CHARS))] + [-float(i) for i in range(len(JOINED))]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.add_space_prefix": add_space_prefix}


def llama_cpp(text: str, meta: dict) -> list[int]:
    """llama.cpp's SentencePiece tokenization of `text` (special tokens parsed)."""
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    vocab = {t: (i, s) for i, (t, s) in enumerate(zip(tokens, scores))}
    ids: list[int] = []
    rest = text
    while rest:
        at = min(((rest.find(s), s) for s in SPECIALS if s in rest), default=(len(rest), ""))
        if at[0] > 0:
            ids += _fragment(rest[:at[0]], vocab, meta["tokenizer.ggml.add_space_prefix"])
        if at[1]:
            ids.append(vocab[at[1]][0])
        rest = rest[at[0] + len(at[1]):]
    return ids


def _fragment(text: str, vocab: dict, prefix: bool) -> list[int]:
    symbols = list(((" " if prefix else "") + text).replace(" ", SPACE))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            joined = symbols[i] + symbols[i + 1]
            if joined in vocab and (best is None or vocab[joined][1] > best[0]):
                best = (vocab[joined][1], i)
        if best is None:
            break
        i = best[1]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    ids = []
    for s in symbols:
        ids += [vocab[s][0]] if s in vocab else [vocab[f"<0x{b:02X}>"][0] for b in s.encode()]
    return ids


TEXTS = ["the thing", " the", "a  b", "babab", "abab", "sssss", "été tinting", "ü is not here", "hé!",
         "<s>the</s> the", "</s></s>", "in<unk>in", "", " ", "\n\tx"]


def test_known_texts_tokenize_as_llama_cpp_does():
    for prefix in (True, False):
        meta = _meta(prefix)
        tok = Tokenizer.from_str(build_tokenizer(meta).to_str())  # as the conversion saves and loads it
        for text in TEXTS:
            assert tok.encode(text, add_special_tokens=False).ids == llama_cpp(text, meta), (prefix, text)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "e", "h", "i", "n", "t", "s", "g", "é", " ", "ü", "x", "</s>"]),
                max_size=24).map("".join))
def test_any_text_tokenizes_as_llama_cpp_does_and_decodes_back(text):
    meta = _meta()
    tok = build_tokenizer(meta)
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids == llama_cpp(text, meta)
    if "</s>" not in text:  # special tokens are skipped when decoding
        assert tok.decode(ids) == text


def test_bos_is_prepended_unless_the_gguf_says_otherwise():
    meta = _meta()
    assert build_tokenizer(meta).encode("the").ids[0] == 1 and tokenizer_config(meta, 64)["add_bos_token"]
    meta["tokenizer.ggml.add_bos_token"] = False
    assert build_tokenizer(meta).encode("the").ids[0] != 1 and not tokenizer_config(meta, 64)["add_bos_token"]


def test_a_gguf_with_a_sentencepiece_vocabulary_converts_and_serves(tmp_path):
    """A tiny Llama GGUF carrying this vocabulary converts, and the engine encodes prompts
    as llama.cpp does (BOS first, as the file asks) and generates from them."""
    from specserve import Engine
    from specserve.models.gguf import convert_gguf
    from tests.unit.test_gguf import tiny_model, write_tiny_gguf

    meta = _meta()
    model = tiny_model("llama", vocab_size=len(meta["tokenizer.ggml.tokens"]))
    write_tiny_gguf(tmp_path / "m.gguf", model, "llama", add_bos=True, spm=meta)
    convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    with Engine(str(tmp_path / "out"), log_level="warning") as engine:
        assert engine.tokenizer.encode("the thing") == [1] + llama_cpp("the thing", meta)
        out = engine.generate(["the thing"], {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})[0]
    assert len(out["output_ids"]) == 6 and isinstance(out["text"], str)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["the", " thing", " ", "a", "b", "é", "ü", "ting", "in", "\n"]), max_size=12).map("".join))
def test_streamed_text_is_the_whole_decode(text):
    """The streaming detokenizer's deltas (one id at a time) join to the full decode, the
    space that each stretch's "▁" prefix stands for dropped once at the start."""
    from specserve.tokenizer.streaming import IncrementalDetokenizer
    from specserve.tokenizer.tokenizer import Tokenizer as Ours

    tok = Ours(build_tokenizer(_meta()), bos_token_id=1, eos_token_ids=frozenset({2}), add_bos_token=False,
               chat_template=None, special_tokens={})
    ids = tok.encode(text)
    stream = IncrementalDetokenizer(tok)
    assert "".join(stream.push([i]) for i in ids) + stream.flush() == tok.decode(ids) == text
