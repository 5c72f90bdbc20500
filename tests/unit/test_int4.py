"""4-bit weights: our int4 layout (models/quant_int4.py), the AWQ and GPTQ checkpoints it is
converted from, and the fused dequantize-GEMV/few-token kernel (kernels/int4.py).

Synthetic checkpoints are built by `pack_awq`/`pack_gptq` from `quantize_int4` of a random
weight; hand-packed int32 words pin each format's nibble order independently of those
helpers. The kernel runs compiled on CUDA and under TRITON_INTERPRET=1 on the CPU (set by
conftest.py before triton is first imported), against the torch path `linear_int4`.
"""
from __future__ import annotations

import pytest
import torch

from specserve.models.quant_int4 import (
    INT4,
    Int4Config,
    convert_int4,
    dequantize_int4,
    from_awq,
    from_gptq,
    int4_config,
    int4_in_features,
    linear_int4,
    pack_awq,
    pack_gptq,
    pack_nibbles,
    quantize_int4,
    unpack_nibbles,
)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
N, K, G = 40, 200, 64  # K ragged: 3 groups of 64 and one of 8


def _weight(n: int = N, k: int = K, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(n, k) * 0.05


def _word(value: int) -> int:
    """An unsigned 32-bit pattern as the int32 a checkpoint stores."""
    return value - (1 << 32) if value >= 1 << 31 else value


# -- the layout and quantize_int4 ---------------------------------------------------------

def test_nibbles_are_low_for_even_k():
    q = torch.tensor([[1, 2, 15, 0], [7, 8, 9, 10]])
    data = pack_nibbles(q)
    assert data.dtype == torch.uint8 and data.tolist() == [[0x21, 0x0F], [0x87, 0xA9]]
    assert torch.equal(unpack_nibbles(data), q.to(torch.uint8))


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_quantize_error_is_within_half_a_step(sym, scale_dtype):
    w = _weight()
    w[0] = 0  # an all-zero row: scale 1, exact zeros
    w[1] = w[1].abs() + 0.01  # all positive: 0 still inside the range
    qw = quantize_int4(w, G, sym=sym, scale_dtype=scale_dtype)
    assert qw.method == INT4 and qw.group == G and int4_in_features(qw) == K
    assert qw.data.shape == (N, K // 2) and qw.data.dtype == torch.uint8
    assert qw.scale.shape == qw.zeros.shape == (N, 4) and qw.scale.dtype == torch.float32
    assert qw.zeros.dtype == torch.uint8 and int(qw.zeros.max()) <= 15
    if sym:
        assert bool((qw.zeros == 8).all())
    assert torch.equal(qw.scale, qw.scale.to(scale_dtype).float())
    err = (dequantize_int4(qw) - w).abs()
    step = qw.scale.repeat_interleave(G, dim=1)[:, :K]
    assert bool((err <= step / 2 * (1 + 1e-5)).all()), (err / step).max()
    assert bool((dequantize_int4(qw)[0] == 0).all()) and bool((qw.scale[0] == 1).all())


def test_odd_k_is_refused():
    with pytest.raises(ValueError, match="even number of input features"):
        quantize_int4(torch.randn(8, 7), 4)


# -- hand-packed words: each format's nibble order ----------------------------------------

def test_awq_word_known_answer():
    # nibble i of 0x76543210 is i; AWQ puts nibble i at column (0, 2, 4, 6, 1, 3, 5, 7)[i]
    qweight = torch.tensor([[_word(0x76543210)], [_word(0xFEDCBA98)]], dtype=torch.int32)  # K 2, N 8
    qzeros = torch.tensor([[_word(0x10325476)]], dtype=torch.int32)
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)
    qw = from_awq(qweight, qzeros, scales, 2)
    q = unpack_nibbles(qw.data).tolist()
    assert [row[0] for row in q] == [0, 4, 1, 5, 2, 6, 3, 7]
    assert [row[1] for row in q] == [8, 12, 9, 13, 10, 14, 11, 15]
    # zeros word nibbles (6, 7, 4, 5, 2, 3, 0, 1) at columns (0, 2, 4, 6, 1, 3, 5, 7)
    assert qw.zeros[:, 0].tolist() == [6, 2, 7, 3, 4, 0, 5, 1]
    assert dequantize_int4(qw)[1].tolist() == [(4 - 2) * 0.5, (12 - 2) * 0.5]


@pytest.mark.parametrize("v2", [False, True])
def test_gptq_word_known_answer(v2):
    # qweight [K/8 = 1, N = 8]: column 0 holds k = 0..7 -> 0..7, column 1 -> 8..15
    qweight = torch.zeros(1, 8, dtype=torch.int32)
    qweight[0, 0], qweight[0, 1] = _word(0x76543210), _word(0xFEDCBA98)
    qzeros = torch.tensor([[_word(0x76543210)]], dtype=torch.int32)  # column n stores n
    scales = torch.ones(1, 8, dtype=torch.float16)
    qw = from_gptq(qweight, qzeros, scales, 8, sym=False, v2=v2)
    q = unpack_nibbles(qw.data)
    assert q[0].tolist() == list(range(8)) and q[1].tolist() == list(range(8, 16))
    assert bool((q[2:] == 0).all())
    assert qw.zeros[:, 0].tolist() == [n + (0 if v2 else 1) for n in range(8)]  # v1 stores zero - 1


# -- synthetic checkpoints ----------------------------------------------------------------

def _same(got, want):
    assert torch.equal(got.data, want.data) and torch.equal(got.zeros, want.zeros)
    assert torch.equal(got.scale, want.scale) and got.group == want.group and got.method == want.method
    assert torch.equal(dequantize_int4(got), dequantize_int4(want))


def test_awq_checkpoint_converts_to_the_same_values():
    w = _weight()
    qw = quantize_int4(w, G, scale_dtype=torch.float16)
    layer = pack_awq(qw)
    assert layer["qweight"].shape == (K, N // 8) and layer["qzeros"].shape == (4, N // 8)
    assert layer["scales"].shape == (4, N) and layer["scales"].dtype == torch.float16
    cfg = int4_config({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": G,
                                               "zero_point": True, "version": "GEMM"}})
    assert cfg == Int4Config("awq", G)
    _same(convert_int4(layer, cfg), qw)


@pytest.mark.parametrize("sym,v2", [(False, False), (True, False), (False, True)])
def test_gptq_checkpoint_converts_to_the_same_values(sym, v2):
    w = _weight(seed=1)
    qw = quantize_int4(w, G, sym=sym, scale_dtype=torch.float16)
    layer = pack_gptq(qw, v2=v2)
    assert layer["qweight"].shape == (K // 8, N) and layer["qzeros"].shape == (4, N // 8)
    qc = {"quant_method": "gptq", "bits": 4, "group_size": G, "sym": sym, "desc_act": False}
    if v2:
        qc["checkpoint_format"] = "gptq_v2"
    cfg = int4_config({"quantization_config": qc})
    assert cfg == Int4Config("gptq", G, sym=sym, v2=v2)
    _same(convert_int4(layer, cfg), qw)
    if sym:  # a symmetric layer without qzeros: zero point 8
        _same(convert_int4({k: v for k, v in layer.items() if k != "qzeros"}, cfg), qw)


def test_whole_row_groups():
    w = _weight(k=64)
    qw = quantize_int4(w, -1, scale_dtype=torch.float16)
    assert qw.group == 64 and qw.scale.shape == (N, 1)
    _same(from_awq(**pack_awq(qw), group=-1), qw)
    layer = pack_gptq(qw)
    _same(from_gptq(layer["qweight"], layer["qzeros"], layer["scales"], -1, sym=False), qw)


def test_gptq_act_order_is_refused_unless_trivial():
    qw = quantize_int4(_weight(), G, scale_dtype=torch.float16)
    layer = pack_gptq(qw)
    cfg = Int4Config("gptq", G, sym=False, desc_act=True)
    _same(convert_int4(layer, cfg), qw)  # desc_act with the trivial g_idx: fine
    perm = dict(layer, g_idx=layer["g_idx"][torch.randperm(K, generator=torch.Generator().manual_seed(0))])
    with pytest.raises(ValueError, match="act-order"):
        convert_int4(perm, cfg)
    with pytest.raises(ValueError, match="desc_act"):
        convert_int4({k: v for k, v in layer.items() if k != "g_idx"}, cfg)


def test_gptq_v1_cannot_store_a_zero_point_of_zero():
    qw = quantize_int4(_weight().abs(), G, scale_dtype=torch.float16)  # all positive: zero points 0
    with pytest.raises(ValueError, match="v2=True"):
        pack_gptq(qw)
    _same(from_gptq(**pack_gptq(qw, v2=True), group=G, sym=False, v2=True), qw)


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "only 4-bit"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "only 4-bit"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "only 'gemm'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size=0"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format"),
])
def test_unsupported_configs_say_why(qc, message):
    with pytest.raises(ValueError, match=message) as e:
        int4_config({"quantization_config": qc})
    assert "\n" not in str(e.value)


def test_configs_that_are_not_int4():
    assert int4_config({}) is None
    assert int4_config({"quantization_config": {"quant_method": "fp8"}}) is None
    cfg = int4_config({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": -1,
                                               "desc_act": True}})
    assert cfg == Int4Config("gptq", -1, sym=True, desc_act=True)


# -- the kernel ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def int4_matmul():
    pytest.importorskip("triton")
    import tests.unit.triton_interp  # noqa: F401  (the interpreter's fixes for old triton)
    from specserve.kernels.int4 import int4_matmul

    return int4_matmul


def _on_dev(qw):
    return qw._replace(data=qw.data.to(DEV), scale=qw.scale.to(DEV), zeros=qw.zeros.to(DEV))


def _check(got, ref, x, qw, residual):
    """fp32: the reference up to the fp32 sum order. Half types: one ulp of the product and
    one of the residual sum (the interpreter rounds fp32 -> bf16 by truncation; the weights
    are exact in bf16 here, see the test)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    got, ref = got.float(), ref.float()
    err = (got - ref).abs()
    if x.dtype == torch.float32:
        bound = 1e-6 * (x.abs() @ dequantize_int4(qw).to(x.device).abs().t()) + 1e-6
    else:
        lin = linear_int4(x, qw).float()
        bound = 2**-7 * (lin.abs() + (ref.abs() if residual is not None else 0)) + 1e-6
    assert bool((err <= bound).all()), (err - bound).max()


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 16, 17, 32])
def test_kernel_equals_the_torch_path(int4_matmul, tokens, dtype, residual):
    torch.manual_seed(tokens)
    qw = quantize_int4(_weight(seed=tokens), G)
    if dtype == torch.bfloat16:  # power-of-two scales: every weight value exact in bf16
        qw = qw._replace(scale=torch.exp2(torch.round(torch.log2(qw.scale))))
    qw = _on_dev(qw)
    x = torch.randn(tokens, K, device=DEV).to(dtype)
    r = torch.randn(tokens, N, device=DEV).to(dtype) if residual else None
    got = int4_matmul(x, qw, residual=r)
    _check(got, linear_int4(x, qw, residual=r), x, qw, r)


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_kernel_odd_groups_and_many_tokens(int4_matmul, tokens):
    """Group 48 holds no power-of-two tile: scales gathered per column (last group ragged:
    200 = 4 x 48 + 8). 40 tokens take two token blocks."""
    torch.manual_seed(5)
    qw = _on_dev(quantize_int4(_weight(n=24), 48))
    x = torch.randn(tokens, K, device=DEV)
    _check(int4_matmul(x, qw), linear_int4(x, qw), x, qw, None)


def test_kernel_fp16_to_fp32_out(int4_matmul):
    torch.manual_seed(7)
    qw = _on_dev(quantize_int4(_weight(n=48, k=256), 128))
    x = torch.randn(4, 256, device=DEV).half()
    r = torch.randn(4, 48, device=DEV).half()
    got = int4_matmul(x, qw, residual=r, out_dtype=torch.float32)
    ref = linear_int4(x, qw, residual=r, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)


def test_kernel_reads_a_converted_checkpoint(int4_matmul):
    qw = quantize_int4(_weight(seed=3), G, scale_dtype=torch.float16)
    awq = _on_dev(convert_int4(pack_awq(qw), Int4Config("awq", G)))
    x = torch.randn(2, K, device=DEV)
    _check(int4_matmul(x, awq), linear_int4(x, _on_dev(qw)), x, awq, None)


# -- served on a GPU as q4 blocks -----------------------------------------------------------

@pytest.mark.parametrize("group, k", [(32, 512), (64, 512), (128, 512), (-1, 512), (128, 320)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_int4_as_q4_blocks_holds_the_same_values(group, k, scale_dtype):
    """Groups kept up to 8 blocks, also where the last is ragged (320 = 2.5 x 128)."""
    from specserve.core.quant import Q4, dequantize_gguf, int4_to_q4

    qw = quantize_int4(_weight(k=k, seed=group % 7), group, scale_dtype=scale_dtype)
    blocks = int4_to_q4(qw)
    assert blocks.method == Q4 and blocks.data.shape == qw.data.shape
    assert blocks.group == (32 if group == -1 else group)  # a whole row (16 blocks): a scale a block
    assert blocks.scale.dtype == (torch.float16 if scale_dtype == torch.float16 else torch.float32)
    ref = dequantize_int4(qw)
    torch.testing.assert_close(dequantize_gguf(blocks), ref, rtol=2**-22, atol=2**-22 * float(ref.abs().max()))


def test_gpu_layout_serves_int4_layers_as_q4_blocks():
    from specserve.core.quant import Q4, dequantize_gguf
    from specserve.models.layers import Linear, gpu_layout

    layers = torch.nn.ModuleList([Linear(256, 48), Linear(200, 24)])  # the second: K not whole blocks
    for layer in layers:
        n, k = layer.weight.shape
        qw = quantize_int4(_weight(n=n, k=k), 64 if k % 64 == 0 else 40)
        layer.quantize_storage(qw.group, INT4)
        with torch.no_grad():
            for dest, src in ((layer.weight, qw.data), (layer.weight_scale, qw.scale), (layer.weight_zeros, qw.zeros)):
                dest.copy_(src)
    before = [layer.quantized for layer in layers]
    gpu_layout(layers)
    assert layers[0].method == Q4 and layers[1].method == INT4
    torch.testing.assert_close(dequantize_gguf(layers[0].quantized), dequantize_int4(before[0]),
                               rtol=2**-22, atol=1e-7)
