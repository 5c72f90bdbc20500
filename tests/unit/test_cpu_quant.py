"""GGUF blocks on the CPU: the repacking (models/gguf_blocks.py) gives gguf's own values
bit for bit, and the C kernels (kernels/cpu_quant.py) give x @ the dequantized weight."""
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
@pytest.mark.parametrize("shape", [(1, 256), (7, 512), (33, 1536)])
def test_kernel_equals_the_dequantized_product(kind, shape):
    rows, cols = shape
    r = gguf_blocks.repack(_raw(kind, rows, cols, np.random.default_rng(rows)), kind, rows, cols)
    qw = _qw(r)
    w = qw.dequantize(torch.float64)
    for m in (1, 2, 3, 4, 5, 9, 16, 70):  # every tile shape, and past a 64-row chunk
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
        ref = x.double() @ w.t()
        got = cpu_quant.matmul(x, qw)
        assert got.dtype == torch.float32 and got.shape == (m, rows)
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        for row in {0, m - 1, m // 2}:  # a row's sums do not depend on M nor on where it sits
            assert torch.equal(cpu_quant.matmul(x[row:row + 1], qw)[0], got[row])


@needs_kernels
def test_threads_change_nothing():
    r = gguf_blocks.repack(_raw(T.Q4_1, 64, 1024, np.random.default_rng(0)), T.Q4_1, 64, 1024)
    x = torch.randn(3, 1024)
    assert torch.equal(cpu_quant.matmul(x, _qw(r), threads=1), cpu_quant.matmul(x, _qw(r), threads=2))
