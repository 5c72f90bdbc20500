"""EAGLE-2 / EAGLE-3 / MTP draft models: loading synthetic published-layout checkpoints,
forward semantics against plain-torch references written from the formulas, and errors."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from specserve.attention.torch_ref import TorchRefBackend
from specserve.cache.kv_pool import KVPool
from specserve.cache.req_table import ReqToTokenTable
from specserve.core.forward_batch import ForwardBatch, ForwardMode
from specserve.models.draft_layouts import add_mtp_deepseek, add_mtp_mimo, read_tensors, save_eagle2, save_eagle3
from specserve.models.draft_loader import load_draft
from specserve.models.eagle import LlamaForCausalLMEagle
from specserve.models.eagle3 import LlamaForCausalLMEagle3
from specserve.models.llama import LlamaConfig
from specserve.models.loader import load_model
from specserve.models.mtp import DeepseekNextN, MiMoMTP, has_mtp_layers
from specserve.models.token_map import load_token_map
from specserve.spec.eagle import LAYOUTS
from tests.unit.model_utils import BareRunner, save_tiny_hf

CPU, F32 = torch.device("cpu"), torch.float32
IDS = [7, 300, 41, 5, 99, 12, 260, 3, 77, 150, 8]  # prompt-like tokens, positions 0..10


def _target(tmp_path: Path, kind: str = "llama", **kw) -> tuple[Path, object]:
    path = save_tiny_hf(kind, tmp_path / f"target_{kind}", **kw)
    return path, load_model(path, F32, CPU)


def _w(linear) -> torch.Tensor:
    """A Linear's [out, in] weight, whether or not it switched to the CPU GEMV layout."""
    return linear.weight if linear.weight is not None else linear.weight_t.t()


# -- a bare forward through a ForwardBatch (one request, row 0) ---------------------------

class _Runner:
    def __init__(self, cfg: LlamaConfig) -> None:
        self.pool = KVPool(64, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, F32, CPU)
        self.table = ReqToTokenTable(2, 64, CPU)
        self.backend, self.used = TorchRefBackend(), 0

    def batch(self, tokens: list[int]) -> ForwardBatch:
        """The next len(tokens) positions of request row 0."""
        prefix, n = self.used, len(tokens)
        slots = torch.arange(1 + prefix, 1 + prefix + n)
        self.table.write(0, prefix, slots)
        self.used += n
        mode = ForwardMode.DECODE if prefix and n == 1 else ForwardMode.DRAFT_EXTEND
        fb = ForwardBatch(mode, torch.tensor(tokens), torch.arange(prefix, prefix + n), slots,
                          torch.tensor([0]), [prefix], [n], self.table.table, self.pool, self.backend,
                          logit_rows=torch.arange(n))
        self.backend.init_forward_metadata(fb)
        return fb


@torch.inference_mode()
def _target_features(target, aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    target.aux_layers = aux_layers
    try:
        return target(_Runner(target.config).batch(IDS))
    finally:
        target.aux_layers = ()


@torch.inference_mode()
def _run_draft(draft, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Extend over IDS fed `features`, then one decode step fed the draft's own last h_next.
    Returns (logits [T + 1, V_draft], the extend's h_next [T, H]; its last row was fed)."""
    r = _Runner(draft.config)
    h_logits, h_next = draft(r.batch(IDS), features)
    h_logits2, _ = draft(r.batch([IDS[-1]]), h_next[-1:])
    return draft.compute_logits(torch.cat([h_logits, h_logits2])), h_next


# -- plain-torch references, from the formulas --------------------------------------------

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    d = x.shape[-1]  # x [T, heads, D], rotate-half convention
    freqs = pos[:, None].float() / theta ** (torch.arange(0, d, 2).float() / d)
    cos, sin = torch.cat([freqs.cos()] * 2, -1)[:, None], torch.cat([freqs.sin()] * 2, -1)[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def _lin(sd: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    bias = sd.get(f"{name}.bias")
    return x @ sd[f"{name}.weight"].T + (0 if bias is None else bias)


def _attention(sd: dict, p: str, x: torch.Tensor, heads: int = 4, kv_heads: int = 2, d: int = 16) -> torch.Tensor:
    t, pos = x.shape[0], torch.arange(x.shape[0])
    q = _rope(_lin(sd, p + "q_proj", x).view(t, heads, d), pos)
    k = _rope(_lin(sd, p + "k_proj", x).view(t, kv_heads, d), pos).repeat_interleave(heads // kv_heads, 1)
    v = _lin(sd, p + "v_proj", x).view(t, kv_heads, d).repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, heads * d)
    return _lin(sd, p + "o_proj", out)


def _mlp(sd: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    return _lin(sd, p + "down_proj", F.silu(_lin(sd, p + "gate_proj", x)) * _lin(sd, p + "up_proj", x))


def _layer(sd: dict, p: str, x: torch.Tensor, input_norm: bool = True) -> torch.Tensor:
    h = _rms(x, sd[p + "input_layernorm.weight"]) if input_norm else x
    x = x + _attention(sd, p + "self_attn.", h)
    return x + _mlp(sd, p + "mlp.", _rms(x, sd[p + "post_attention_layernorm.weight"]))


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def _ids() -> torch.Tensor:
    return torch.tensor(IDS + [IDS[-1]])  # the extend tokens, then the decode token


# -- llama.py: aux capture, MTP trunks ----------------------------------------------------

def test_aux_layers_in_requested_order_and_after_last_layer(tmp_path):
    path, target = _target(tmp_path)
    sd = read_tensors(path)
    hidden, aux = _target_features(target, (2, 0, 1))
    assert len(aux) == 3
    torch.testing.assert_close(_rms(aux[0], sd["model.norm.weight"]), hidden)  # 2 == L: pre-norm output
    torch.testing.assert_close(aux[1], sd["model.embed_tokens.weight"][IDS])  # before layer 0
    torch.testing.assert_close(aux[2], _layer(sd, "model.layers.0.", aux[1]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,add", [("llama", add_mtp_deepseek), ("qwen2", add_mtp_deepseek),
                                      ("qwen2", add_mtp_mimo)])
def test_target_loads_from_a_checkpoint_with_mtp_layers(tmp_path, kind, add):
    path, before = _target(tmp_path, kind)
    logits = BareRunner(before).forward([0], [0], [IDS])
    add(path, num_mtp=2)
    assert has_mtp_layers(path)
    after = load_model(path, F32, CPU)
    if add is add_mtp_mimo:
        assert after.config.architecture == "MiMoForCausalLM" and after.config.attention_bias
    torch.testing.assert_close(BareRunner(after).forward([0], [0], [IDS]), logits, rtol=0, atol=0)


# -- round trips: every saved tensor where it belongs -------------------------------------

@pytest.mark.parametrize("bias,layers,arch", [(True, 1, "LlamaForCausalLMEagle"), (False, 2, "LlamaForCausalLMEagle"),
                                              (True, 1, "LlamaForCausalLM")])  # last: EAGLE trainer layout
def test_eagle2_round_trip(tmp_path, bias, layers, arch):
    path, target = _target(tmp_path)
    d = load_draft(save_eagle2(tmp_path / "e2", path, bias, num_layers=layers, architecture=arch), target,
                   LAYOUTS["EAGLE"], F32, CPU)
    sd = read_tensors(tmp_path / "e2")
    assert isinstance(d, LlamaForCausalLMEagle) and d.feature_mode == "final" and d.aux_layers == ()
    assert d.config.num_layers == layers and d.token_map is None
    assert torch.equal(_w(d.fc), sd["fc.weight"])
    assert (d.fc.bias is not None) == bias and (not bias or torch.equal(d.fc.bias, sd["fc.bias"]))
    for i, layer in enumerate(d.layers):
        p = f"layers.{i}."
        qkv = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(_w(layer.self_attn.qkv_proj), qkv)
        assert torch.equal(_w(layer.self_attn.o_proj), sd[p + "self_attn.o_proj.weight"])
        gate_up = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        assert torch.equal(_w(layer.mlp.gate_up_proj), gate_up)
        assert torch.equal(_w(layer.mlp.down_proj), sd[p + "mlp.down_proj.weight"])
        assert torch.equal(layer.post_attention_layernorm.weight, sd[p + "post_attention_layernorm.weight"])
        if i == 0:
            assert isinstance(layer.input_layernorm, torch.nn.Identity)
        else:
            assert torch.equal(layer.input_layernorm.weight, sd[p + "input_layernorm.weight"])
    assert d.embed_tokens.weight is target.model.embed_tokens.weight
    assert d.lm_head is target.lm_head


def test_eagle2_token_map_truncates_the_shared_head(tmp_path):
    path, target = _target(tmp_path)
    ids = torch.tensor([5, 500, 17, 3, 250, 0])
    d = load_draft(save_eagle2(tmp_path / "e2", path, True), target, LAYOUTS["EAGLE"], F32, CPU, token_map=ids)
    assert torch.equal(d.token_map, ids) and torch.equal(d.lm_head.weight, target.lm_head.weight[ids])
    assert d.embed_tokens.weight is target.model.embed_tokens.weight  # the embedding stays full
    h = torch.randn(3, 64)
    torch.testing.assert_close(d.compute_logits(h), target.compute_logits(h)[:, ids])


@pytest.mark.parametrize("arch", ["LlamaForCausalLMEagle3", "LlamaForCausalLM"])
def test_eagle3_round_trip(tmp_path, arch, caplog):
    path, target = _target(tmp_path)
    e3 = save_eagle3(tmp_path / "e3", path, draft_vocab=96, aux_ids=[-1, 0, 1], architecture=arch)
    with caplog.at_level(logging.WARNING, logger="specserve"):
        d = load_draft(e3, target, LAYOUTS["EAGLE3"], F32, CPU, token_map=torch.tensor([1, 2, 3]))
    assert "EAGLE3 models already have this" in caplog.text
    sd = read_tensors(e3)
    assert isinstance(d, LlamaForCausalLMEagle3) and d.feature_mode == "aux" and d.config.num_layers == 1
    assert d.aux_layers == (0, 1, 2)  # output of layer id = before layer id + 1
    assert torch.equal(d.token_map, torch.arange(96) + sd["d2t"])
    assert torch.equal(d.token_map, sd["t2d"].nonzero().flatten())  # the hot ids, in order
    assert torch.equal(_w(d.fc), sd["fc.weight"]) and d.fc.bias is None
    m = d.midlayer
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        assert torch.equal(getattr(m, name).weight, sd[f"midlayer.{name}.weight"])
    qkv = torch.cat([sd[f"midlayer.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert qkv.shape[1] == 128 and torch.equal(_w(m.self_attn.qkv_proj), qkv)
    assert torch.equal(_w(m.mlp.down_proj), sd["midlayer.mlp.down_proj.weight"])
    assert torch.equal(d.norm.weight, sd["norm.weight"]) and torch.equal(d.lm_head.weight, sd["lm_head.weight"])
    assert d.embed_tokens.weight is target.model.embed_tokens.weight


def test_eagle3_defaults_and_target_head(tmp_path):
    path, target = _target(tmp_path, num_hidden_layers=4)
    d = load_draft(save_eagle3(tmp_path / "e3", path, draft_vocab=None), target, LAYOUTS["EAGLE3"], F32, CPU)
    assert d.aux_layers == (2, 2, 1)  # (2, L//2, L-3) for L = 4
    assert d.lm_head is target.lm_head and d.token_map is None


def test_mtp_deepseek_round_trip(tmp_path, caplog):
    path, target = _target(tmp_path)
    add_mtp_deepseek(path, num_mtp=2)
    with caplog.at_level(logging.INFO, logger="specserve"):
        d = load_draft(path, target, LAYOUTS["EAGLE"], F32, CPU)
    assert "2 MTP layers" in caplog.text
    sd = read_tensors(path)
    p = "model.layers.2."  # L = 2: the first MTP layer
    assert isinstance(d, DeepseekNextN) and d.feature_mode == "final" and d.config.num_layers == 1
    for ours, theirs in ((d.enorm, "enorm"), (d.hnorm, "hnorm"), (d.shared_head["norm"], "shared_head.norm"),
                         (d.decoder.input_layernorm, "input_layernorm")):
        assert torch.equal(ours.weight, sd[f"{p}{theirs}.weight"])
    assert torch.equal(_w(d.eh_proj), sd[p + "eh_proj.weight"])
    qkv = torch.cat([sd[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(_w(d.decoder.self_attn.qkv_proj), qkv)
    assert d.lm_head is target.lm_head and d.embed_tokens.weight is target.model.embed_tokens.weight


def test_mtp_mimo_round_trip(tmp_path):
    path, target = _target(tmp_path, "qwen2")
    add_mtp_mimo(path)
    d = load_draft(path, target, LAYOUTS["EAGLE"], F32, CPU)
    sd, p = read_tensors(path), "model.mtp_layers.0."
    assert isinstance(d, MiMoMTP) and d.config.attention_bias
    for name in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        assert torch.equal(getattr(d, name).weight, sd[f"{p}{name}.weight"])
    assert torch.equal(_w(d.input_proj), sd[p + "input_proj.weight"])
    bias = torch.cat([sd[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"])
    assert torch.equal(d.mtp_block.self_attn.qkv_proj.bias, bias)
    assert d.lm_head is target.lm_head


# -- semantics: DraftModel.forward + compute_logits against the formulas ------------------

@pytest.mark.parametrize("bias,layers", [(True, 2), (False, 1)])
def test_eagle2_forward_matches_reference(tmp_path, bias, layers):
    path, target = _target(tmp_path)
    d = load_draft(save_eagle2(tmp_path / "e2", path, bias, num_layers=layers), target, LAYOUTS["EAGLE"], F32, CPU)
    hidden, _ = _target_features(target)
    logits, h_next = _run_draft(d, hidden)
    sd, tsd = read_tensors(tmp_path / "e2"), read_tensors(path)
    x = _lin(sd, "fc", torch.cat([tsd["model.embed_tokens.weight"][_ids()], torch.cat([hidden, h_next[-1:]])], -1))
    for i in range(layers):
        x = _layer(sd, f"layers.{i}.", x, input_norm=i > 0)
    _close(h_next, x[:-1])
    _close(logits, x @ tsd["lm_head.weight"].T)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_eagle3_forward_matches_reference(tmp_path, norm_before_residual):
    path, target = _target(tmp_path)
    e3 = save_eagle3(tmp_path / "e3", path, draft_vocab=96, aux_ids=[-1, 0, 1])
    if norm_before_residual:  # vLLM's flag
        cfg = json.loads((e3 / "config.json").read_text())
        (e3 / "config.json").write_text(json.dumps(cfg | {"norm_before_residual": True}))
    d = load_draft(e3, target, LAYOUTS["EAGLE3"], F32, CPU)
    _, aux = _target_features(target, d.aux_layers)
    logits, h_next = _run_draft(d, torch.cat(aux, -1))  # 3H wide, then the draft's own H-wide hidden
    sd, tsd = read_tensors(e3), read_tensors(path)
    h = torch.cat([_lin(sd, "fc", torch.cat(aux, -1)), h_next[-1:]])
    e = _rms(tsd["model.embed_tokens.weight"][_ids()], sd["midlayer.input_layernorm.weight"])
    hn = _rms(h, sd["midlayer.hidden_norm.weight"])
    x = (hn if norm_before_residual else h) + _attention(sd, "midlayer.self_attn.", torch.cat([e, hn], -1))
    out = x + _mlp(sd, "midlayer.mlp.", _rms(x, sd["midlayer.post_attention_layernorm.weight"]))
    _close(h_next, out[:-1])  # pre-norm
    _close(logits, _rms(out, sd["norm.weight"]) @ sd["lm_head.weight"].T)


def test_mtp_deepseek_forward_matches_reference(tmp_path):
    path, target = _target(tmp_path)
    add_mtp_deepseek(path)
    d = load_draft(path, target, LAYOUTS["EAGLE"], F32, CPU)
    hidden, _ = _target_features(target)
    logits, h_next = _run_draft(d, hidden)
    sd, p = read_tensors(path), "model.layers.2."
    e = _rms(sd["model.embed_tokens.weight"][_ids()], sd[p + "enorm.weight"])  # the target's embedding
    x = _lin(sd, p + "eh_proj", torch.cat([e, _rms(torch.cat([hidden, h_next[-1:]]), sd[p + "hnorm.weight"])], -1))
    out = _rms(_layer(sd, p, x), sd[p + "shared_head.norm.weight"])
    _close(h_next, out[:-1])  # normed, as SGLang feeds it back
    _close(logits, out @ sd["lm_head.weight"].T)


def test_mtp_mimo_forward_matches_reference(tmp_path):
    path, target = _target(tmp_path, "qwen2")
    add_mtp_mimo(path)
    d = load_draft(path, target, LAYOUTS["EAGLE"], F32, CPU)
    hidden, _ = _target_features(target)
    logits, h_next = _run_draft(d, hidden)
    sd, p = read_tensors(path), "model.mtp_layers.0."
    embeds = sd["model.embed_tokens.weight"][_ids()].clone()
    embeds[0] = 0  # position 0
    x = torch.cat([_rms(torch.cat([hidden, h_next[-1:]]), sd[p + "hidden_layernorm.weight"]),
                   _rms(embeds, sd[p + "token_layernorm.weight"])], -1)
    out = _rms(_layer(sd, p, _lin(sd, p + "input_proj", x)), sd[p + "final_layernorm.weight"])
    _close(h_next, out[:-1])  # normed, as SGLang feeds it back
    _close(logits, out @ sd["lm_head.weight"].T)


# -- errors --------------------------------------------------------------------------------

def test_algorithm_mismatch(tmp_path):
    """Start-up names the algorithm a draft's layout needs (spec/eagle: check_layout); the
    loader itself refuses a layout it was not asked for."""
    from specserve.spec.eagle import check_layout

    path, target = _target(tmp_path)
    e3 = save_eagle3(tmp_path / "e3", path, draft_vocab=96, aux_ids=[-1, 0, 1])
    with pytest.raises(ValueError, match="EAGLE-3 head: use --speculative-algorithm EAGLE3"):
        check_layout("EAGLE", e3)
    with pytest.raises(ValueError, match="is an EAGLE-3 head, not an EAGLE-2 head or a model with MTP layers"):
        load_draft(e3, target, LAYOUTS["EAGLE"], F32, CPU)
    e2 = save_eagle2(tmp_path / "e2", path, True)
    with pytest.raises(ValueError, match="EAGLE-2 head: use --speculative-algorithm EAGLE$"):
        check_layout("EAGLE3", e2)
    with pytest.raises(ValueError, match="not a draft model"):
        load_draft(path, target, LAYOUTS["EAGLE"], F32, CPU)  # the target itself, without MTP layers
    add_mtp_deepseek(path)
    with pytest.raises(ValueError, match="MTP layers: use --speculative-algorithm EAGLE$"):
        check_layout("EAGLE3", path)


def _drop_or_add(path: Path, drop: str | None = None, add: dict | None = None) -> None:
    tensors = read_tensors(path)
    tensors.pop(drop, None)
    save_file(tensors | (add or {}), path / "model.safetensors", metadata={"format": "pt"})


def test_missing_and_unexpected_tensors(tmp_path):
    path, target = _target(tmp_path)
    e2 = save_eagle2(tmp_path / "e2", path, True)
    _drop_or_add(e2, drop="layers.0.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match=r"missing 1 tensors.*layers\.0\.self_attn\.k_proj\.weight"):
        load_draft(e2, target, LAYOUTS["EAGLE"], F32, CPU)
    e2 = save_eagle2(tmp_path / "e2b", path, True)
    _drop_or_add(e2, add={"layers.0.input_layernorm.weight": torch.ones(64)})
    with pytest.raises(ValueError, match=r"unexpected.*layers\.0\.input_layernorm\.weight"):
        load_draft(e2, target, LAYOUTS["EAGLE"], F32, CPU)
    add_mtp_deepseek(path)
    _drop_or_add(path, drop="model.layers.2.hnorm.weight")
    with pytest.raises(ValueError, match=r"missing 1 tensors.*model\.layers\.2\.hnorm\.weight"):
        load_draft(path, target, LAYOUTS["EAGLE"], F32, CPU)


def test_eagle3_layer_count_and_vocab_checks(tmp_path):
    path, target = _target(tmp_path)
    e3 = save_eagle3(tmp_path / "e3", path, draft_vocab=96, aux_ids=[-1, 0, 1])
    cfg = json.loads((e3 / "config.json").read_text())
    (e3 / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="EAGLE3 currently only supports 1 layer"):
        load_draft(e3, target, LAYOUTS["EAGLE3"], F32, CPU)
    (e3 / "config.json").write_text(json.dumps(cfg | {"vocab_size": 1000}))
    with pytest.raises(ValueError, match="vocab_size"):
        load_draft(e3, target, LAYOUTS["EAGLE3"], F32, CPU)
    (e3 / "config.json").write_text(json.dumps(cfg))
    _drop_or_add(e3, add={"d2t": torch.full((96,), 600)})
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        load_draft(e3, target, LAYOUTS["EAGLE3"], F32, CPU)


def test_token_map_file(tmp_path):
    with pytest.raises(ValueError, match="does not download token maps"):
        load_token_map(str(tmp_path / "freq_32768.pt"), 512)
    torch.save([3, 9, 1, 511], tmp_path / "ok.pt")
    ids = load_token_map(str(tmp_path / "ok.pt"), 512)
    assert ids.dtype == torch.int64 and ids.tolist() == [3, 9, 1, 511]
    torch.save(torch.tensor([3, 512]), tmp_path / "range.pt")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        load_token_map(str(tmp_path / "range.pt"), 512)
    torch.save([3, 4, 3], tmp_path / "dup.pt")
    with pytest.raises(ValueError, match="repeated"):
        load_token_map(str(tmp_path / "dup.pt"), 512)
