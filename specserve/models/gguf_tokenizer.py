"""GGUF tokenizer metadata -> Hugging Face tokenizer files.

Owns how llama.cpp's vocabularies (`tokenizer.ggml.*`) become a `tokenizers` Tokenizer:
byte-level BPE ("gpt2": pre-tokenizer regex chosen by `tokenizer.ggml.pre`) and
SentencePiece's ("llama": Llama 1/2, Mistral, TinyLlama; `_spm`), special tokens added; and
the `tokenizer_config.json` / `generation_config.json` contents (chat template, BOS/EOS,
end-of-generation tokens). Weights and model config are `gguf.py`'s business.
"""
from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# tokenizer.ggml.pre -> pre-tokenizer family; the regexes are llama.cpp's (llama-vocab.cpp),
# which are also what the models' own tokenizer.json files use.
_PRE_FAMILIES = {
    "default": "gpt2", "gpt2": "gpt2", "gpt-2": "gpt2", "mpt": "gpt2", "olmo": "gpt2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits",
    "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3", "smaug-bpe": "llama3",
    "falcon3": "llama3", "dbrx": "llama3",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "stablelm2": "qwen2",
}
_SPLITS = {
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# Texts llama.cpp treats as end-of-generation when they are in the vocabulary.
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|eom_id|>", "<EOT>", "<|end_of_text|>", "<end_of_utterance>"}
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4  # tokenizer.ggml.token_type values


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the GGUF's byte-level BPE vocabulary."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        return _with_specials(_spm(meta), meta)
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported yet (supported: gpt2, llama)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_FAMILIES:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(_PRE_FAMILIES)})")
    family = _PRE_FAMILIES[pre]
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    # tiktoken-derived vocabularies (llama3) look a whole pre-token up before merging
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     ignore_merges=family == "llama3", fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    if family == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(family)
    tok.decoder = decoders.ByteLevel()
    return _with_specials(tok, meta)


def _with_specials(tok: Tokenizer, meta: dict[str, Any]) -> Tokenizer:
    """`tok` with the vocabulary's unknown, control and user-defined tokens matched whole
    in any text (llama.cpp's special tokens), and BOS prepended where the GGUF says llama.cpp
    adds it."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or []
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k in (_UNKNOWN, _CONTROL)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == _USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if _add_bos(meta) and bos is not None:  # so HF AutoTokenizer adds BOS as llama.cpp does
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)])
    return tok


def _spm(meta: dict[str, Any]) -> Tokenizer:
    """SentencePiece's vocabulary as llama.cpp tokenizes with it: spaces become "▁" (one
    prepended to each stretch of text between special tokens when `add_space_prefix`, the
    default), then from single characters the adjacent pair whose joined piece scores
    highest merges first (the leftmost of equals), and a piece left outside the vocabulary
    falls back to its UTF-8 bytes' <0xXX> tokens. That is BPE with every split of every
    piece into two pieces as a merge, ranked by the joined piece's score. SentencePiece's
    BPE vocabularies give each piece its own score; where two different pairs' pieces tie,
    the merge ranked first here (by the pieces' ids) goes first, not the leftmost pair."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores: list[float] = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for piece, score in zip(tokens, scores):
        ranked += [(-score, vocab[piece[:i]], vocab[piece[i:]], piece[:i], piece[i:])
                   for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
    ranked.sort()
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(left, right) for *_, left, right in ranked],
                               unk_token=tokens[unk] if unk is not None else None, fuse_unk=True,
                               byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", "\u2581")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), spaces]) if prefix else spaces
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _pre_tokenizer(family: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=family in ("gpt2", "digits"))
    if family == "gpt2":
        return byte_level
    if family == "digits":  # each digit alone, then the GPT-2 regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = pre_tokenizers.Split(Regex(_SPLITS[family]), behavior="isolated")
    return pre_tokenizers.Sequence([split, byte_level])


def _add_bos(meta: dict[str, Any]) -> bool:
    """Whether llama.cpp prepends BOS: as the GGUF says, else for SentencePiece and llama3 vocabularies."""
    default = (meta.get("tokenizer.ggml.model") == "llama"
               or _PRE_FAMILIES.get(meta.get("tokenizer.ggml.pre", "default")) == "llama3")
    return bool(meta.get("tokenizer.ggml.add_bos_token", default))


def tokenizer_config(meta: dict[str, Any], max_length: int) -> dict[str, Any]:
    """`tokenizer_config.json`: special token strings, BOS policy, chat template."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]

    def text(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config = {
        "add_bos_token": _add_bos(meta), "add_eos_token": False,
        "bos_token": text("bos_token_id"), "eos_token": text("eos_token_id"),
        "unk_token": text("unknown_token_id"), "pad_token": text("padding_token_id"),
        "chat_template": meta.get("tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False, "model_max_length": max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    return {k: v for k, v in config.items() if v is not None}


def generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    """`generation_config.json`: every end-of-generation id llama.cpp would stop on."""
    eos = meta.get("tokenizer.ggml.eos_token_id")
    ids = [i for i in (eos, meta.get("tokenizer.ggml.eot_token_id"), meta.get("tokenizer.ggml.eom_token_id"))
           if i is not None]
    types = meta.get("tokenizer.ggml.token_type") or []
    ids += [i for i, (t, k) in enumerate(zip(meta["tokenizer.ggml.tokens"], types))
            if k == _CONTROL and t in _EOG_TEXTS]
    ids = list(dict.fromkeys(ids))  # dedupe, keep order: the GGUF's eos first
    config = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
              "eos_token_id": ids[0] if len(ids) == 1 else ids or None,
              "pad_token_id": meta.get("tokenizer.ggml.padding_token_id")}
    return {k: v for k, v in config.items() if v is not None}
