"""fp8 weights: the format's round trip, the few-token kernels against dequantize-then-matmul,
the prefill product, and fp8 Hugging Face checkpoints (per tensor, per channel, 128x128
blocks) and float ones quantized at load landing on the right values."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specserve import kernels
from specserve.core import quant
from specserve.core.quant import QuantWeight
from specserve.models import quantization
from specserve.models.layers import Linear
from specserve.models.loader import load_model
from specserve.models.quant_linear import quant_linear, quantize_tokens
from tests.unit.fused_utils import DEV, gpu_float32_tiles  # first: TRITON_INTERPRET before triton loads
from tests.unit.model_utils import save_tiny_hf

pytest.importorskip("triton")


def _fp8(n: int, k: int, group: int | None = None, seed: int = 0) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    data, scale = quant.quantize_fp8(torch.randn(n, k, generator=g) * 0.05, group)
    return QuantWeight(data.to(DEV), scale.to(DEV), group or k)


def test_round_trip_within_e4m3_rounding():
    w = torch.randn(37, 300) * torch.logspace(-3, 1, 37)[:, None]
    w[5] = 0
    for group in (None, 128):
        data, scale = quant.quantize_fp8(w, group)
        back = quant.dequantize_fp8(data, scale, group or 300)
        per_col = scale.repeat_interleave(group or 300, dim=1)[:, :300]
        # e4m3: 3 mantissa bits (half an ulp: 2^-4 of the value); subnormals below 2^-6 * scale
        bound = torch.maximum(w.abs() * 2 ** -4, per_col * 2 ** -10)
        assert (back - w).abs().le(bound).all()
        assert back[5].eq(0).all() and scale[5].eq(1).all()
        assert (back.abs().amax(dim=1) <= w.abs().amax(dim=1) * (1 + 2 ** -4)).all()


def _reference(x, qw, norm_weight, residual, gated):
    w = qw.dequantize(torch.float32)
    h = x.float() if norm_weight is None else F.rms_norm(x.float(), (x.shape[1],), norm_weight.float(), 1e-6)
    y = h.to(x.dtype).float() @ w.T
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = y + residual.float()
    return y


@pytest.mark.parametrize("tokens", [1, 5, 16, 20])
@pytest.mark.parametrize("shape", [(40, 200, None), (48, 200, 64), (64, 96, None)])
@pytest.mark.parametrize("fused", ["plain", "norm", "gated", "residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_few_token_kernels_match_dequantized_product(tokens, shape, fused, dtype):
    """matvec.py (one token) and skinny.py read fp8 weights with per-row and ragged
    per-group scales as a dequantized weight's product (fp16: within its rounding)."""
    n, k, group = shape
    qw = _fp8(2 * n if fused == "gated" else n, k, group)
    x = torch.randn(tokens, k, device=DEV).to(dtype)
    norm_weight = (torch.rand(k, device=DEV) + 0.5) if fused in ("norm", "gated") else None
    residual = torch.randn(tokens, n, device=DEV).to(dtype) if fused == "residual" else None
    with kernels.fused_kernels(True), torch.no_grad():
        got = kernels.gemv(x, qw, norm_weight=None if norm_weight is None else norm_weight.to(dtype), eps=1e-6,
                           residual=residual, gated=fused == "gated")
    ref = _reference(x, qw, None if norm_weight is None else norm_weight.to(dtype), residual, fused == "gated")
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", [(40, 200, None), (48, 200, 64)])
@pytest.mark.parametrize("fused", ["norm", "gated", "residual"])
def test_float32_tiles_read_fp8(shape, fused, monkeypatch):
    """float32 activations over fp8 weights on a GPU's float32 launch shapes
    (skinny_config.f32_config for 132 SMs: 16 x 32 tiles, K split) as a dequantized
    weight's product, per-row and per-group scales."""
    from specserve.kernels import skinny

    gpu_float32_tiles(monkeypatch, skinny)
    n, k, group = shape
    qw = _fp8(2 * n if fused == "gated" else n, k, group)
    x = torch.randn(9, k, device=DEV)
    norm_weight = (torch.rand(k, device=DEV) + 0.5) if fused != "residual" else None
    residual = torch.randn(9, n, device=DEV) if fused == "residual" else None
    with kernels.fused_kernels(True), torch.no_grad():
        got = kernels.gemv(x, qw, norm_weight=norm_weight, eps=1e-6, residual=residual, gated=fused == "gated")
    ref = _reference(x, qw, norm_weight, residual, fused == "gated")
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


def test_tma_path_reads_fp8():
    """The descriptor path (forced on: the interpreter runs it) takes fp8 boxes."""
    from specserve.kernels import skinny

    qw = _fp8(64, 512)
    x = torch.randn(4, 512, device=DEV)
    saved, skinny.TMA_OVERRIDE = skinny.TMA_OVERRIDE, True
    try:
        with kernels.fused_kernels(True), torch.no_grad():
            got = kernels.gemv(x, qw)
    finally:
        skinny.TMA_OVERRIDE = saved
    torch.testing.assert_close(got, _reference(x, qw, None, None, False), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("group", [None, 128])
def test_tma_path_splits_a_narrow_fp8_layer(group, monkeypatch):
    """A narrow fp8 layer on the descriptor path takes K in parts (skinny_config._fp8_split:
    one 64-row program against 132 SMs, 1104 columns in 4 parts of 256-deep boxes, the last
    without a column): plain, with its deferred norm and with a residual, as the reference;
    the split's counts are 0 again after each launch."""
    from specserve.kernels import skinny, skinny_config

    monkeypatch.setattr(skinny_config, "device_limits", lambda device: (1 << 20, 132))
    monkeypatch.setattr(skinny, "TMA_OVERRIDE", True)
    qw, x = _fp8(64, 1104, group), torch.randn(5, 1104, device=DEV)
    assert skinny._tma_config(64, 1104, False, True, 4, 16, DEV, fp8=True).split == 4
    norm_weight, residual = torch.rand(1104, device=DEV) + 0.5, torch.randn(5, 64, device=DEV)
    for nw, res in ((None, None), (norm_weight, None), (None, residual)):
        with kernels.fused_kernels(True), torch.no_grad():
            got = kernels.gemv(x, qw, norm_weight=nw, eps=1e-6, residual=res)
        torch.testing.assert_close(got, _reference(x, qw, nw, res, False), atol=2e-5, rtol=2e-5)
        assert not skinny_config.counts(DEV).any()


def test_qkv_rope_store_reads_fp8():
    """The fused qkv + RoPE + KV write takes an fp8 weight as the plain GEMV does."""
    from specserve.models.rope import RotaryEmbedding

    heads, kv_heads, dim, k, t = 2, 1, 16, 64, 3
    qw = _fp8((heads + 2 * kv_heads) * dim, k)
    rotary = RotaryEmbedding(dim, 64, 10000.0, None)
    rotary.build(DEV, torch.float32)
    rope = rotary.at(torch.tensor([3, 4, 5], device=DEV))
    x = torch.randn(t, k, device=DEV)
    slots = torch.tensor([1, 2, 3], device=DEV)
    caches = [torch.zeros(8, kv_heads, dim, device=DEV) for _ in range(4)]
    with kernels.fused_kernels(True), torch.no_grad():
        q = kernels.qkv_rope_store(x, qw, heads, rope, caches[0], caches[1], slots)
        qkv = kernels.gemv(x, qw.dequantize(torch.float32))
        q_ref = kernels.rope_store_kv(qkv.view(t, -1, dim), heads, *rope.tables(), caches[2], caches[3], slots)
    assert q is not None
    torch.testing.assert_close(q, q_ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(caches[0], caches[2], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(caches[1], caches[3], atol=2e-5, rtol=2e-5)


def test_prefill_product_is_the_dequantized_weights():
    """Many tokens on the CPU (and in float32 anywhere): F.linear on the dequantized weight."""
    qw = _fp8(24, 40)
    x = torch.randn(50, 40, device=DEV)
    torch.testing.assert_close(quant_linear(x, qw), x @ qw.dequantize(torch.float32).T)


def test_token_scales_map_each_row_to_the_fp8_range():
    x = torch.randn(6, 32) * torch.tensor([1e-3, 1, 10, 100, 1e4, 0.5])[:, None]
    xq, xs = quantize_tokens(x)
    assert xq.dtype == quant.FP8 and xs.shape == (6, 1)
    assert torch.allclose(xq.float().abs().amax(dim=1), torch.full((6,), 448.0))
    assert ((xq.float() * xs - x).abs() <= x.abs() * 2 ** -4 + 1e-30).all()


def test_linear_storage_and_cpu_form():
    layer = Linear(40, 24)
    w = torch.randn(24, 40)
    data, scale = quant.quantize_fp8(w)
    layer.quantize_storage()
    assert layer.weight.dtype == quant.FP8 and layer.weight_scale is not None
    with torch.no_grad():
        layer.weight.copy_(data)
        layer.weight_scale.copy_(scale)
    x = torch.randn(3, 40)
    expected = x @ quant.dequantize_fp8(data, scale, 40).T
    torch.testing.assert_close(layer(x), expected)
    layer.dequantize_storage(torch.float32)
    layer.use_gemv_layout()
    assert layer.quantized is None
    torch.testing.assert_close(layer(x), expected)


# ---- checkpoints ----------------------------------------------------------------------------

def _fp8_checkpoint(src, dst, scheme: str) -> dict[str, torch.Tensor]:
    """An fp8 checkpoint written from the float one at `src`, quantized as `scheme`
    ('tensor', 'channel', 'block': 16x16 blocks, the tiny model's scale of 128x128), as
    quantization tools save them; returns the expected dequantized weights by HF name."""
    tensors, expected = load_file(str(src / "model.safetensors")), {}
    out = {}
    for name, t in tensors.items():
        if not (name.endswith("proj.weight") and t.dim() == 2):
            out[name] = t
            continue
        w = t.float()
        if scheme == "tensor":
            s = w.abs().amax() / 448
            data = (w / s).to(quant.FP8)
            out[name + "_scale"], back = s.reshape(()), data.float() * s
        elif scheme == "channel":
            data, s = quant.quantize_fp8(w)
            out[name + "_scale"], back = s, quant.dequantize_fp8(data, s, w.shape[1])
        else:
            rows = -(-w.shape[0] // 16)
            s = torch.stack([torch.stack([w[r * 16:(r + 1) * 16, c * 16:(c + 1) * 16].abs().amax() / 448
                                          for c in range(-(-w.shape[1] // 16))]) for r in range(rows)])
            per = s.repeat_interleave(16, 0)[:w.shape[0]].repeat_interleave(16, 1)[:, :w.shape[1]]
            data = (w / per).to(quant.FP8)
            out[name + "_scale_inv"], back = s, data.float() * per
        out[name], expected[name] = data, back
        out[name.replace(".weight", ".input_scale")] = torch.ones(())  # static activation scales: unused
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  **({"weight_block_size": [16, 16]} if scheme == "block" else {})}
    (dst / "config.json").write_text(json.dumps(cfg))
    return expected


def _weights(model) -> dict[str, torch.Tensor]:
    """The model's linear weights by HF name, as float [out, in] (q/k/v and gate/up split)."""
    cfg, out = model.config, {}
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        qkv, gu = a.qkv_proj.out_in_weight, m.gate_up_proj.out_in_weight
        pre = f"model.layers.{i}"
        out |= {f"{pre}.self_attn.q_proj.weight": qkv[:q], f"{pre}.self_attn.k_proj.weight": qkv[q:q + kv],
                f"{pre}.self_attn.v_proj.weight": qkv[q + kv:], f"{pre}.self_attn.o_proj.weight": a.o_proj.out_in_weight,
                f"{pre}.mlp.gate_proj.weight": gu[:cfg.intermediate_size],
                f"{pre}.mlp.up_proj.weight": gu[cfg.intermediate_size:],
                f"{pre}.mlp.down_proj.weight": m.down_proj.out_in_weight}
    return out


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_fp8_checkpoints_load_to_their_values(tmp_path, scheme):
    src = save_tiny_hf("llama", tmp_path / "float", intermediate_size=120)  # 120: a ragged last block
    expected = _fp8_checkpoint(src, tmp_path / "fp8", scheme)
    model = load_model(tmp_path / "fp8", torch.float32, torch.device("cpu"))
    assert model.weight_quant == quantization.WeightQuant("fp8", (16, 16) if scheme == "block" else None, True)
    got = _weights(model)
    for name, w in expected.items():
        torch.testing.assert_close(got[name], w, atol=0, rtol=1e-6, msg=name)


def test_float_checkpoint_quantized_at_load(tmp_path):
    src = save_tiny_hf("llama", tmp_path / "float")
    model = load_model(src, torch.float32, torch.device("cpu"), quantization="fp8")
    got = _weights(model)
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name in got:
            data, scale = quant.quantize_fp8(t)
            torch.testing.assert_close(got[name], quant.dequantize_fp8(data, scale, t.shape[1]), atol=0, rtol=0)
    info = quantization.info(model)
    assert info["method"] == "fp8" and not info["from_checkpoint"]


def test_checkpoint_and_flag_must_agree(tmp_path):
    src = save_tiny_hf("llama", tmp_path / "float")
    _fp8_checkpoint(src, tmp_path / "fp8", "channel")
    with pytest.raises(ValueError, match="stored in fp8"):
        load_model(tmp_path / "fp8", torch.float32, torch.device("cpu"), quantization="awq")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes"}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantized with 'bitsandbytes', which is not supported"):
        load_model(src, torch.float32, torch.device("cpu"))


def test_missing_scale_is_named(tmp_path):
    src = save_tiny_hf("llama", tmp_path / "float")
    _fp8_checkpoint(src, tmp_path / "fp8", "channel")
    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj.weight_scale"):
        load_model(tmp_path / "fp8", torch.float32, torch.device("cpu"))


def test_bytes_per_weight_counts_scales():
    layer = Linear(256, 64)
    layer.quantize_storage()
    total, count = quantization.weight_bytes(layer)
    assert count == 64 * 256 and total == 64 * 256 + 64 * 4


def test_activation_dtype_skips_quantized_storage():
    """Buffers sized from a model's dtype (graphs' features) must not take an fp8 layer's:
    an EAGLE-3 head's first parameter is its fp8 `fc`."""
    from torch import nn

    from specserve.models.layers import RMSNorm, activation_dtype

    model = nn.Sequential(Linear(32, 16), RMSNorm(16, 1e-6)).to(torch.bfloat16)
    model[0].quantize_storage()
    assert next(model.parameters()).dtype == quant.FP8
    assert activation_dtype(model) == torch.bfloat16
