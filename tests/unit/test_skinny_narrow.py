"""The few-token kernel's launch shapes for a narrow model (skinny_config.config's
SmolLM2 rules, from a sweep on the GPU) against the torch ops: gate_up, down_proj and a
narrow lm_head at the token counts of a verify and a draft."""
from __future__ import annotations

import pytest
import torch

from tests.unit.fused_utils import DEV, DTYPES  # first: sets TRITON_INTERPRET on CPU

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from specserve import kernels  # noqa: E402
from tests.unit.test_fused_kernels import _close, _random_forms  # noqa: E402


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])  # 2-byte weights' tiles
@pytest.mark.parametrize("t,n,k", [(12, 1536, 576), (32, 1536, 576), (32, 576, 1536)])
def test_skinny_narrow_model_tiles_are_the_unfused_chain(t, n, k, dtype, monkeypatch):
    """SmolLM2's launches on an H100's 132 SMs (skinny_config.config): gate_up's 16 x 128
    tiles on 2 warps at up to 16 tokens and 16 x 64 at 32, and down_proj's 32 x 256 tiles
    split 6 ways at 32 tokens, give every fused form as the torch ops do."""
    from specserve.kernels import skinny, skinny_config

    monkeypatch.setattr(skinny_config, "device_limits", lambda device: (227 * 1024 - 8 * 1024, 132))

    block_t = 16 if t <= 16 else 32
    if k == 576:
        assert tuple(skinny._config(n, k, True, True, 2, block_t, DEV))[:2] == ((16, 128) if t <= 16 else (16, 64))
    else:
        assert tuple(skinny._config(n, k, False, False, 2, block_t, DEV))[:4] == (32, 256, 4, 6)
    _random_forms(t, n, k, dtype)
    assert not skinny._counts(DEV).any()


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
@pytest.mark.parametrize("t", [1, 32])
def test_narrow_lm_head_tiles_are_the_linear(t, dtype):
    """A narrow model's lm_head (16384 rows, 576 columns: a SmolLM2 draft head's) on 64 x 64
    tiles and 2 warps, at one token and a few: F.linear's logits, widened to float32."""
    from specserve.kernels import skinny

    assert tuple(skinny._config(16384, 576, False, False, 2, 16, DEV)) == (64, 64, 4, 1, 2)
    x = torch.randn(t, 576, device=DEV).to(dtype)
    w = torch.randn(16384, 576, device=DEV).div(24).to(dtype)
    with kernels.fused_kernels(True):
        got = kernels.gemv(x, w, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    _close(got.to(dtype), F.linear(x, w))  # the half logits, widened
