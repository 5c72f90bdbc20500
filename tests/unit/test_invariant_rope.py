"""The deterministic mode's qkv with RoPE and the KV write in its epilogue (kernels/invariant_rope.py).

Compiled on CUDA, under TRITON_INTERPRET=1 on a CPU. The one launch gives the bits of the two
it replaces (`invariant_matmul` over the qkv weight, then `rope_store_kv`): the rotated
queries, and the keys and values at the rows' slots, in a bf16 and an fp8 cache, with and
without a bias, for row counts whose K splits take a program each and for longer calls
whose programs walk them. Rows therefore keep the invariant product's independence of the
row count.
"""
from __future__ import annotations

import pytest
import torch

from tests.unit.triton_interp import DEV  # first: sets TRITON_INTERPRET on CPU (and widens bf16 dots)

pytest.importorskip("triton")

from specserve import kernels  # noqa: E402
from specserve.core.rope import RopeAt  # noqa: E402
from specserve.kernels import invariant_mm, invariant_rope  # noqa: E402

BF16 = torch.bfloat16
HEADS, KV_HEADS, K = 2, 1, 200


def _table(positions: int, dim: int) -> torch.Tensor:
    """[positions, 2 dim]: cos, then signed sin (the first half negated), as models/rope.py builds it."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    ang = torch.arange(positions).float()[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], 1)
    sin = torch.sin(ang)
    sin[:, :dim // 2] *= -1
    return torch.cat([torch.cos(ang), sin], 1)


@pytest.mark.parametrize("dim, bias, kv_dtype, rows", [(64, False, BF16, (1, 5, 16)), (32, True, BF16, (3, 70)),
                                                      (64, True, torch.float8_e4m3fn, (2, 70))])
def test_the_fused_launch_is_the_product_then_rope_and_the_kv_write(dim, bias, kv_dtype, rows):
    g = torch.Generator().manual_seed(dim)
    n = (HEADS + 2 * KV_HEADS) * dim
    w = (torch.randn(n, K, generator=g) / K ** 0.5).to(DEV, BF16)
    b = torch.randn(n, generator=g).to(DEV, BF16) if bias else None
    table = _table(256, dim).to(DEV, BF16)
    scales = (0.5, 0.25) if kv_dtype != BF16 else (1.0, 1.0)
    assert invariant_rope.fuses(w, dim, RopeAt(table, torch.zeros(1, dtype=torch.long, device=DEV), dim))
    for m in rows:
        x = torch.randn(m, K, generator=g).to(DEV, BF16)
        norm = (1e-5, kernels.row_sumsq(x))
        rope = RopeAt(table, torch.randint(0, 256, (m,), generator=g).to(DEV), dim)
        slots = torch.randperm(2 * m, generator=g)[:m].to(DEV)
        caches = [[torch.zeros(2 * m, KV_HEADS, dim, device=DEV).to(kv_dtype) for _ in range(2)] for _ in range(2)]
        fused = kernels.invariant_qkv_rope(x, w, b, HEADS, rope, *caches[0], slots, norm=norm, k_scale=scales[0],
                                           v_scale=scales[1])
        qkv = invariant_mm.invariant_matmul(x, w, b, norm=norm)
        apart = kernels.rope_store_kv(qkv.view(m, -1, dim), HEADS, *rope.tables(), *caches[1], slots,
                                      k_scale=scales[0], v_scale=scales[1])
        assert fused is not None and torch.equal(fused, apart), m
        for a, c in zip(caches[0], caches[1], strict=True):
            assert torch.equal(a.view(torch.uint8), c.view(torch.uint8)), m  # fp8: compare the bytes


def test_heads_narrower_than_a_tile_take_the_two_launches():
    w = torch.zeros((HEADS + 2 * KV_HEADS) * 16, K, dtype=BF16, device=DEV)
    rope = RopeAt(_table(8, 16).to(DEV, BF16), torch.zeros(1, dtype=torch.long, device=DEV), 16)
    caches = [torch.zeros(1, KV_HEADS, 16, dtype=BF16, device=DEV) for _ in range(2)]
    x = torch.zeros(1, K, dtype=BF16, device=DEV)
    assert kernels.invariant_qkv_rope(x, w, None, HEADS, rope, *caches, torch.zeros(1, dtype=torch.long, device=DEV),
                                      norm=(1e-5, kernels.row_sumsq(x))) is None
