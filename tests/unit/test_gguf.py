"""GGUF -> HF conversion: tiny synthetic GGUFs written the way llama.cpp writes them, and the
real SmolLM2 file checked tensor for tensor (and logit for logit) against transformers' own
GGUF loader. `write_tiny_gguf` / `tiny_vocab` are reused by the tokenizer and source tests.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

import specserve.models.gguf as conv
from specserve.models.gguf import convert_gguf, is_converted

F32 = Q.F32
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 (CONTROL)
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "1 2", "Ġ Ġ"]
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies spell)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 3 control tokens, 256 bytes, merged tokens, 1 user-defined."""
    merged = ["".join(m.split(" ")) for m in MERGES]
    tokens = SPECIALS + list(bytes_to_unicode().values()) + merged + ["<tool>"]
    types = [3] * len(SPECIALS) + [1] * (256 + len(merged)) + [4]
    return tokens, types, list(MERGES)


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation of q/k rows (HF [out, in] layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_model(arch: str, seed: int = 0, **overrides):
    import transformers as tf

    cfg_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                          "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}[arch]
    extra = {"head_dim": 32} if arch == "qwen3" else {}  # != hidden / heads: must come from key_length
    cfg = cfg_cls(bos_token_id=1, eos_token_id=2, **{"vocab_size": len(tiny_vocab()[0]), **TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases so a wrong mapping shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def write_tiny_gguf(path: Path, model, arch: str, *, pre: str = "smollm", add_bos: bool = False,
                    chat_template: str | None = None, qtypes: dict[str, Q] | None = None,
                    rope_freqs: np.ndarray | None = None, spm: dict | None = None) -> dict[str, torch.Tensor]:
    """Write `model` as llama.cpp would; return the HF state dict the GGUF now holds exactly.
    `spm`: a SentencePiece vocabulary's `tokenizer.ggml.*` fields instead of `tiny_vocab`'s BPE."""
    cfg, qtypes = model.config, qtypes or {}
    theta = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(theta["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "qwen3":
        w.add_key_length(cfg.head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    if spm is None:
        tokens, types, merges = tiny_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
    else:
        w.add_tokenizer_model("llama")
        w.add_token_list(spm["tokenizer.ggml.tokens"])
        w.add_token_scores(spm["tokenizer.ggml.scores"])
        w.add_token_types(spm["tokenizer.ggml.token_type"])
        w.add_unk_token_id(spm["tokenizer.ggml.unknown_token_id"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    if chat_template:
        w.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    expected = {}
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        x = t.detach().numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in hf_name:
            x = permute(x, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            x = permute(x, cfg.num_key_value_heads)
        qt = qtypes.get(name, F32)
        w.add_tensor(name, x if qt == F32 else quantize(x, qt), raw_dtype=qt)
        exact = x if qt == F32 else dequantize(quantize(x, qt), qt).reshape(x.shape)
        expected[hf_name] = t if qt == F32 else torch.from_numpy(exact.copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _load_converted(out: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", False)])
def test_tiny_roundtrip_matches_source_model(tmp_path: Path, arch: str, tied: bool) -> None:
    model = tiny_model(arch, tie_word_embeddings=tied)
    qtypes = {"token_embd.weight": Q.F16, "blk.0.ffn_up.weight": Q.Q8_0, "blk.1.ffn_down.weight": Q.Q4_0}
    expected = write_tiny_gguf(tmp_path / "m.gguf", model, arch, qtypes=qtypes)
    convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert is_converted(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__] and config["model_type"] == arch
    cfg = model.config
    assert config["tie_word_embeddings"] is tied
    assert config["head_dim"] == (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    assert "rope_scaling" not in config
    loaded = _load_converted(tmp_path / "out")
    got = loaded.state_dict()
    for name, t in expected.items():  # exact: permutation undone, names and shapes right
        assert torch.equal(got[name], t), name
    model.load_state_dict(expected, strict=False)  # the quantized tensors as the GGUF holds them
    ids = torch.tensor([[5, 77, 200, 3, 264, 9, 31]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path: Path) -> None:
    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    model = tiny_model("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=65536, rope_theta=500000.0, rope_scaling=dict(params))
    head_dim, theta = 64, 500000.0
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    factors = []  # llama.cpp's LlamaModel.generate_extra_tensors
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            factors.append(1.0)
        elif wavelen > 8192 / 1:
            factors.append(8.0)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            factors.append(1 / ((1 - smooth) / 8 + smooth))
    write_tiny_gguf(tmp_path / "m.gguf", model, "llama", rope_freqs=np.array(factors))
    convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_scaling"] == params
    ids = torch.arange(40).unsqueeze(0) * 6 % 260
    with torch.no_grad():
        torch.testing.assert_close(_load_converted(tmp_path / "out")(ids).logits, model(ids).logits)


def test_failed_conversion_leaves_nothing_and_keeps_old_dir(tmp_path: Path, monkeypatch) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", tiny_model("llama"), "llama")
    out = tmp_path / "out"
    convert_gguf(tmp_path / "m.gguf", out, marker={"v": 1})
    calls = []

    def flaky(t):
        calls.append(t.name)
        if len(calls) == 5:
            raise KeyboardInterrupt  # an interrupted conversion, mid-tensors
        return real(t)

    real = conv._dequant
    monkeypatch.setattr(conv, "_dequant", flaky)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(tmp_path / "m.gguf", out, marker={"v": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "out"]  # no temp dir left
    assert json.loads((out / conv.MARKER).read_text())["v"] == 1
    monkeypatch.setattr(conv, "_dequant", real)
    convert_gguf(tmp_path / "m.gguf", out, marker={"v": 3})  # replaces a complete dir
    assert json.loads((out / conv.MARKER).read_text())["v"] == 3


def test_clear_errors(tmp_path: Path, monkeypatch) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", tiny_model("llama"), "llama", qtypes={"blk.0.ffn_up.weight": Q.Q8_0})

    def unsupported(data, qtype):
        if qtype == Q.Q8_0:
            raise NotImplementedError("nope")
        return dequantize(data, qtype)

    monkeypatch.setattr(conv, "dequantize", unsupported)
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up\.weight' has type Q8_0"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "mystery"}
    with pytest.raises(ValueError, match="pre-tokenizer 'mystery' is not supported"):
        conv.build_tokenizer(meta)
    with pytest.raises(ValueError, match="'t5' is not supported yet"):
        conv.build_tokenizer({"tokenizer.ggml.model": "t5"})


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for n_head in (1, 2, 3, 6):
        assert np.array_equal(conv.unpermute_qk(permute(w, n_head), n_head), w)
    b = np.arange(12, dtype=np.float32)  # a bias permutes the same way
    assert np.array_equal(conv.unpermute_qk(permute(b, 3), 3), b)


# ---- the real SmolLM2 file against transformers' GGUF loader --------------------------------

@pytest.fixture(scope="module")
def hf_gguf_model(smollm2_gguf: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                dtype=torch.float32).eval()


@pytest.mark.slow
def test_smollm2_state_dict_equals_transformers(smollm2_dir: Path, hf_gguf_model) -> None:
    from safetensors.torch import load_file

    ours = load_file(smollm2_dir / "model.safetensors")
    theirs = hf_gguf_model.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: no lm_head tensor
    for name, t in ours.items():  # exact: same data, same dequantization, Q/K un-permuted alike
        assert torch.equal(t, theirs[name]), name


@pytest.mark.slow
def test_smollm2_logits_and_config_match_transformers(smollm2_dir: Path, hf_gguf_model) -> None:
    ours = _load_converted(smollm2_dir)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "rms_norm_eps"):
        assert getattr(ours.config, key) == pytest.approx(getattr(hf_gguf_model.config, key)), key
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 2, 198, 1, 4093, 198, 26843, 2]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, hf_gguf_model(ids).logits)
