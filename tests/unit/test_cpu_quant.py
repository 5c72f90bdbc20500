"""GGUF blocks on the CPU: the repacking (models/gguf_blocks.py) gives gguf's own values
bit for bit, and the C kernels (kernels/cpu_quant.py) give x, rounded to int16 as they
round it, @ the dequantized weight."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from specserve.core import quant
from specserve.kernels import cpu_quant
from specserve.models import gguf_blocks

SIMPLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)  # gguf-py quantizes these
K_QUANTS = {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}  # bytes a 256-value super-block
F16_FIELDS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}  # where its fp16 scales sit


def _raw(kind: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    if kind in SIMPLE:
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32), kind)
    blocks = rng.integers(0, 256, (rows * cols // 256, K_QUANTS[kind]), dtype=np.uint8)
    for at in F16_FIELDS[kind]:  # finite, sane scales; every other byte is a valid block as it is
        blocks[:, at:at + 2] = (rng.random(len(blocks)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _qw(r: gguf_blocks.Repacked) -> quant.QuantWeight:
    off = None if r.offset is None else torch.from_numpy(r.offset)
    return quant.QuantWeight(torch.from_numpy(r.q), torch.from_numpy(r.scale), r.group, r.method, off)


@pytest.mark.parametrize("kind", [*SIMPLE, *K_QUANTS])
def test_repacked_blocks_are_ggufs_values_bit_for_bit(kind):
    rows, cols = 6, 512
    raw = _raw(kind, rows, cols, np.random.default_rng(int(kind)))
    theirs = torch.from_numpy(np.asarray(dequantize(raw, kind), dtype=np.float32).reshape(rows, cols))
    r = gguf_blocks.repack(raw, kind, rows, cols)
    assert torch.equal(_qw(r).dequantize(torch.float32), theirs)
    perm = np.array([3, 0, 5, 1, 4, 2])
    assert torch.equal(_qw(gguf_blocks.permute_rows(r, perm)).dequantize(torch.float32), theirs[perm])


needs_kernels = pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler: GGUF weights run dequantized")


@needs_kernels
@pytest.mark.parametrize("kind", [T.Q4_1, T.Q4_0, T.Q4_K, T.Q8_0, T.Q6_K, T.Q5_1])
@pytest.mark.parametrize("shape", [(16, 256), (48, 512), (64, 1536)])
def test_kernel_equals_the_dequantized_product(kind, shape):
    rows, cols = shape
    r = gguf_blocks.repack(_raw(kind, rows, cols, np.random.default_rng(rows)), kind, rows, cols)
    qw = _qw(r)
    exact = qw.dequantize(torch.float64)
    for m in (1, 2, 3, 4, 5, 9, 16, 70):  # every row count of a pass, several passes, past a 64-row chunk
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
        got = cpu_quant.matmul(x, qw)
        assert got.dtype == torch.float32 and got.shape == (m, rows)
        ref = cpu_quant.reference(x, qw)  # x rounded as the kernel rounds it: float32 sums apart
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        full = x.double() @ exact.t()  # and the rounding of x is far below the weights' own
        torch.testing.assert_close(got.double(), full, rtol=1e-4, atol=1e-4 * full.abs().max().item())
        for row in {0, m - 1, m // 2}:  # a row's sums do not depend on M nor on where it sits
            assert torch.equal(cpu_quant.matmul(x[row:row + 1], qw)[0], got[row])


@needs_kernels
def test_threads_change_nothing():
    r = gguf_blocks.repack(_raw(T.Q4_1, 64, 1024, np.random.default_rng(0)), T.Q4_1, 64, 1024)
    x = torch.randn(3, 1024)
    assert torch.equal(cpu_quant.matmul(x, _qw(r), threads=1), cpu_quant.matmul(x, _qw(r), threads=2))


@needs_kernels
def test_zero_tiny_and_non_finite_rows():
    qw = _qw(gguf_blocks.repack(_raw(T.Q4_1, 16, 256, np.random.default_rng(1)), T.Q4_1, 16, 256))
    x = torch.randn(4, 256)
    x[0] = 0.0
    x[1, :32] = 1e-35  # a block too small to scale: it counts as zeros in the integer sums
    x[2, 40] = float("nan")
    x[3, 100] = float("inf")
    got = cpu_quant.matmul(x, qw)
    assert torch.equal(got[0], cpu_quant.matmul(torch.zeros(1, 256), qw)[0])
    zeroed = x[1:2].clone()
    zeroed[0, :32] = 0.0
    assert torch.equal(got[1], cpu_quant.matmul(zeroed, qw)[0])  # the other blocks round as they would alone
    assert got[2].isnan().all() and got[3].isnan().all()


@needs_kernels
def test_a_shape_past_the_tiles_runs_dequantized():
    from specserve.models.quant_linear import quant_linear

    qw = _qw(gguf_blocks.repack(_raw(T.Q8_0, 24, 256, np.random.default_rng(2)), T.Q8_0, 24, 256))
    assert not cpu_quant.servable(qw)
    x = torch.randn(3, 256)
    torch.testing.assert_close(quant_linear(x, qw), x @ qw.dequantize(torch.float32).t())


@needs_kernels
def test_the_plain_loops_equal_the_vector_path_bit_for_bit(monkeypatch, tmp_path):
    """cpu_quant.c's loops for machines without AVX-512 follow the vector path's formulas."""
    vector = cpu_quant.library()
    monkeypatch.setattr(cpu_quant, "_lib", None)  # the vector library comes back after the test
    monkeypatch.setattr(cpu_quant, "FLAGS", tuple("-march=x86-64" if f == "-march=native" else f
                                                  for f in cpu_quant.FLAGS))
    monkeypatch.setattr(cpu_quant, "_tried", False)
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    plain = cpu_quant.library()
    assert plain is not None and plain is not vector
    for kind, rows in ((T.Q4_1, 80), (T.Q8_0, 48), (T.Q6_K, 16), (T.Q4_K, 16)):
        qw = _qw(gguf_blocks.repack(_raw(kind, rows, 512, np.random.default_rng(rows)), kind, rows, 512))
        x = torch.randn(5, 512, generator=torch.Generator().manual_seed(rows))
        monkeypatch.setattr(cpu_quant, "_lib", plain)
        got = cpu_quant.matmul(x, qw)
        monkeypatch.setattr(cpu_quant, "_lib", vector)
        assert torch.equal(got, cpu_quant.matmul(x, qw)), kind


@needs_kernels
def test_the_vector_library_is_back_after_the_plain_loops_test():
    """The test above swaps the library: every later test in the process must get the
    machine's own build back (the plain loops are many times slower)."""
    assert "-march=native" in cpu_quant.FLAGS
    lib = cpu_quant.library()
    assert lib is not None and lib._name == str(cpu_quant._build())
