"""The few-token kernel on a GGUF's blocks (kernels/blocks.py) against the torch reference
F.linear(x, qw.dequantize(x.dtype)): q4 with and without offsets, q8 of groups 16 and 32,
one token (multiply-reduce), 2 to 32 (the dot), more (further token blocks), fp32 and bf16,
a residual, float16 scales, and a converted GGUF file's own blocks. Compiled on CUDA and
under TRITON_INTERPRET=1 on the CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.unit.triton_interp import DEV  # first: sets TRITON_INTERPRET where there is no GPU

# isort: split
from specserve.core.quant import Q4, Q8, QuantWeight
from specserve.kernels.blocks import blocks_matmul


def _blocks(method: str, n: int, k: int, group: int, offset: bool, seed: int = 0,
            exact_bf16: bool = False) -> QuantWeight:
    """Random blocks; `exact_bf16`: power-of-two scales and offsets on a coarse grid, so
    every weight is exact in bf16 and the kernel's rounding of it is the reference's."""
    gen = torch.Generator().manual_seed(seed)
    if method == Q4:
        data = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    else:
        data = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int32).to(torch.int8)
    scale = torch.rand(n, k // group, generator=gen) * 0.01 + 1e-3
    zeros = -torch.rand(n, k // group, generator=gen) * 0.05 if offset else None
    if exact_bf16:
        scale = torch.exp2(torch.round(torch.log2(scale)))
        zeros = None if zeros is None else torch.round(zeros * 64) / 64
    qw = QuantWeight(data, scale, group, method, zeros)
    return qw._replace(data=data.to(DEV), scale=scale.to(DEV), zeros=None if zeros is None else zeros.to(DEV))


def _reference(x: torch.Tensor, qw: QuantWeight, residual: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    y = F.linear(x, qw.dequantize(x.dtype))
    if residual is not None:
        y = residual + y
    return y.to(out_dtype or x.dtype)


def _check(got: torch.Tensor, x: torch.Tensor, qw: QuantWeight, residual: torch.Tensor | None = None) -> None:
    """fp32: the reference up to the fp32 sum order. Half types: besides one ulp of the
    product and one of the residual sum, the reference's rounding of each weight to x's
    dtype, which the one-token kernel does not do (half an ulp of each |x w|)."""
    ref = _reference(x, qw, residual)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    err = (got.float() - ref.float()).abs()
    xw = x.float().abs() @ qw.dequantize(torch.float32).abs().t()
    if x.dtype == torch.float32:
        bound = 1e-5 * xw + 1e-6
    else:
        lin = F.linear(x, qw.dequantize(x.dtype)).float()
        bound = 2**-7 * (lin.abs() + (ref.float().abs() if residual is not None else 0)) + 2**-8 * xw + 1e-6
    assert bool((err <= bound).all()), (err - bound).max()


# q4 of group 64: a scale and offset over two blocks, as AWQ/GPTQ weights are held (core/quant.py int4_to_q4)
FORMS = [(Q4, 32, True), (Q4, 32, False), (Q8, 32, False), (Q8, 16, False), (Q8, 32, True), (Q4, 64, True)]


@pytest.mark.parametrize("tokens", [1, 3, 16, 17, 32, 40])
@pytest.mark.parametrize("method,group,offset", FORMS)
def test_kernel_equals_the_torch_path_in_fp32(method, group, offset, tokens):
    qw = _blocks(method, 40, 320, group, offset, seed=tokens)  # 40 rows: a ragged row block
    x = torch.randn(tokens, 320, device=DEV)
    _check(blocks_matmul(x, qw), x, qw)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("tokens", [1, 5, 32])
@pytest.mark.parametrize("method,group,offset", [FORMS[0], FORMS[3]])
def test_kernel_in_bf16_with_a_residual(method, group, offset, tokens, residual):
    qw = _blocks(method, 48, 256, group, offset, seed=tokens, exact_bf16=True)
    x = torch.randn(tokens, 256, device=DEV).bfloat16()
    r = torch.randn(tokens, 48, device=DEV).bfloat16() if residual else None
    _check(blocks_matmul(x, qw, residual=r), x, qw, r)


def test_many_groups_a_row_take_several_tiles():
    """A row of 96 groups walks three 1024-column tiles at one token, the last partial."""
    qw = _blocks(Q4, 8, 96 * 32, 32, True, seed=9)
    for tokens in (1, 4):
        x = torch.randn(tokens, 96 * 32, device=DEV)
        _check(blocks_matmul(x, qw), x, qw)


def test_an_int4_weight_held_as_q4_blocks():
    """AWQ's usual groups of 128 (four blocks a scale), from the int4 layout, in bf16."""
    from specserve.core.quant import int4_to_q4
    from specserve.models.quant_int4 import quantize_int4

    torch.manual_seed(11)
    for k in (512, 576):  # 576: SmolLM2's width, 4.5 groups (the last scale covers 2 blocks)
        int4 = quantize_int4(torch.randn(24, k) * 0.05, 128, scale_dtype=torch.float16)
        qw = int4_to_q4(int4)
        assert qw.group == 128
        qw = qw._replace(data=qw.data.to(DEV), scale=qw.scale.to(DEV), zeros=qw.zeros.to(DEV))
        for tokens in (1, 5, 40):
            x = torch.randn(tokens, k, device=DEV).bfloat16()
            _check(blocks_matmul(x, qw), x, qw)


def test_float16_scales_and_float32_out():
    qw = _blocks(Q4, 32, 256, 32, True, seed=4)
    half = qw._replace(scale=qw.scale.half(), zeros=qw.zeros.half())
    x = torch.randn(3, 256, device=DEV).half()
    r = torch.randn(3, 32, device=DEV).half()
    got = blocks_matmul(x, half, residual=r, out_dtype=torch.float32)
    ref = _reference(x, half._replace(scale=half.scale.float(), zeros=half.zeros.float()), r, torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)


def test_launch_shapes_other_than_the_default_agree():
    qw = _blocks(Q8, 64, 512, 32, True, seed=2)
    x = torch.randn(1, 512, device=DEV)
    base = blocks_matmul(x, qw)
    bound = 1e-5 * (x.abs() @ qw.dequantize(torch.float32).abs().t()) + 1e-6  # fp32 sums in another order
    for launch in ((1, 8, 2), (8, 16, 4), (2, 4, 1)):
        assert bool(((blocks_matmul(x, qw, launch=launch) - base).abs() <= bound).all()), launch


def test_a_converted_gguf_files_blocks(smollm2_dir):
    """SmolLM2's own Q4_1 blocks (and its q8 ones, if any), as the conversion stored them."""
    from safetensors import safe_open

    from specserve.models import gguf_blocks

    path = smollm2_dir / gguf_blocks.BLOCKS_FILE
    methods = gguf_blocks.methods(path)
    seen = set()
    with safe_open(str(path), framework="pt") as f:
        for name, (method, group) in methods.items():
            if method in seen or "layers.0." not in name:
                continue
            seen.add(method)
            keys = f.keys()
            qw = QuantWeight(f.get_tensor(f"{name}.q").to(DEV), f.get_tensor(f"{name}.scale").to(DEV), group, method,
                             f.get_tensor(f"{name}.offset").to(DEV) if f"{name}.offset" in keys else None)
            x = torch.randn(2, qw.shape[1], device=DEV)
            _check(blocks_matmul(x, qw), x, qw)
    assert Q4 in seen


@pytest.mark.parametrize("method", [Q4, Q8])
def test_quantize_blocks_round_trip(method):
    """Random-weight benchmarks' blocks (core/quant.py): within half a step of the weight,
    float16 scales as GGUF stores them, and the q4 nibble order of models/gguf_blocks.py."""
    from specserve.core.quant import quantize_blocks

    w = torch.randn(16, 128) * 0.05
    qw = quantize_blocks(w, method)
    assert qw.scale.dtype == torch.float16 and qw.group == 32 and qw.shape == (16, 128)
    step = qw.scale.float().repeat_interleave(32, dim=1)
    assert bool(((qw.dequantize(torch.float32) - w).abs() <= step / 2 + 1e-3 * step).all())
    if method == Q4:
        lo = qw.zeros.float().repeat_interleave(32, dim=1)
        q = torch.round((w - lo) / step).clamp(0, 15).to(torch.uint8)
        assert torch.equal(qw.data[:, :16], q[:, :16] | (q[:, 16:32] << 4))


@pytest.mark.parametrize("gated", [False, True])
def test_gemv_entry_runs_the_norm_and_silu_apart(gated):
    """`kernels.gemv` over blocks (the few-token path's projections): the norm, the kernel
    (+ residual) and SiLU*mul as separate launches, each rounding as its torch op."""
    from specserve import kernels

    qw = _blocks(Q4, 64, 256, 32, True, seed=3)
    x = torch.randn(3, 256, device=DEV)
    nw = torch.rand(256, device=DEV) + 0.5
    r = None if gated else torch.randn(3, 64, device=DEV)
    with kernels.fused_kernels(True):
        got = kernels.gemv(x, qw, norm_weight=nw, eps=1e-5, residual=r, gated=gated)
    normed = nw * F.rms_norm(x, (256,), None, 1e-5)
    y = F.linear(normed, qw.dequantize(torch.float32))
    ref = F.silu(y[:, :32]) * y[:, 32:] if gated else r + y
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_gemv_entry_at_one_token():
    from specserve import kernels

    qw = _blocks(Q4, 64, 256, 32, True, seed=5)
    x = torch.randn(1, 256, device=DEV)
    nw = torch.rand(256, device=DEV) + 0.5
    normed = nw * F.rms_norm(x, (256,), None, 1e-5)
    y = F.linear(normed, qw.dequantize(torch.float32))
    with kernels.fused_kernels(True):
        gated = kernels.gemv(x, qw, norm_weight=nw, eps=1e-5, gated=True)
        plain = kernels.gemv(x, qw, norm_weight=nw, eps=1e-5)
    torch.testing.assert_close(gated, F.silu(y[:, :32]) * y[:, 32:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(plain, y, rtol=1e-4, atol=1e-5)


def test_split_rows_sum_as_the_unsplit_kernel_does(monkeypatch):
    """Few output tiles: each row's groups split over programs whose sums a second launch
    adds (with the residual); the result is the unsplit kernel's up to the fp32 sum order."""
    from specserve.kernels import blocks, split_k

    qw = _blocks(Q8, 32, 16 * 128, 32, True, seed=6)
    x = torch.randn(5, 16 * 128, device=DEV)
    r = torch.randn(5, 32, device=DEV)
    assert split_k.split_for(1, 16) == 8 and split_k.split_for(600, 16) == 1 and split_k.split_for(1, 3) == 2
    split = blocks.blocks_matmul(x, qw, residual=r)
    monkeypatch.setattr(split_k, "PROGRAMS", 1)
    whole = blocks.blocks_matmul(x, qw, residual=r)
    bound = 1e-5 * (x.abs() @ qw.dequantize(torch.float32).abs().t() + r.abs()) + 1e-6  # fp32 sums in another order
    assert bool(((split - whole).abs() <= bound).all())
    _check(split, x, qw, r)


def test_bench_blocks_times_the_layers_of_the_shape():
    """`specserve bench blocks` (a GPU benchmark): the layers it times are the 8B shape's,
    and without a GPU it says so."""
    from specserve.bench import blocks as bench

    assert bench.layer_shapes("8b") == [("qkv", 6144, 4096, Q4), ("o", 4096, 4096, Q4), ("gate_up", 28672, 4096, Q4),
                                        ("down", 4096, 14336, Q4), ("head", 128256, 4096, Q8)]
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bench.main(["--tokens", "1"])
