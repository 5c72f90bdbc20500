"""The few-token path's choices, no kernel run: which layers take skinny.py (narrow ones,
TMA-streamed wide ones, lm_heads, float32 up to 2048 wide), its launch shapes
(skinny_config.py: tiles, stages, K split, float32's own) within the device's limits, and
which launches prefetch their K tiles into L2."""
from __future__ import annotations

import functools
import itertools

import pytest
import torch

from tests.unit.fused_utils import DEV  # first: sets TRITON_INTERPRET on CPU

pytest.importorskip("triton")

from specserve import kernels  # noqa: E402


def test_skinny_config_fits_the_device(monkeypatch):
    """Llama-8B's, SmolLM2's and Qwen2.5's layers, half and float32 weights, 16 and 32 padded tokens,
    with and without the norm: every stage (weight tile or gated pair, x tile) fits an
    H100's 227 KB with at least one stage; a looped layer that is narrow gets BLOCK_N down
    to 16 before it runs on few programs (an H100 refused 4 stages of gate_up's pair, and
    ran SmolLM2's layers on 9 programs); one tile is taken for rows up to 1024 wide only,
    never gated, and not for 32 normed tokens (the deferred norm runs faster looped)."""
    from specserve.kernels import skinny, skinny_config

    budget, sms = 227 * 1024 - 8 * 1024, 132
    monkeypatch.setattr(skinny_config, "device_limits", lambda device: (budget, sms))
    shapes = [(6144, 4096, False), (4096, 4096, False), (14336, 4096, True), (4096, 14336, False),
              (128256, 4096, False), (960, 576, False), (576, 576, False), (1536, 576, True), (576, 1536, False),
              (49152, 576, False), (2048, 1536, False), (8960, 1536, True), (1536, 8960, False),
              (151936, 1536, False), (896, 4864, False), (4864, 896, True), (151936, 896, False)]
    for (n, k, gated), w_bytes, block_t, norm in itertools.product(shapes, (2, 4), (16, 32), (False, True)):
        dev = torch.device("cuda") if w_bytes == 4 else DEV  # float32's tiles are a GPU's
        block_n, block_k, stages, split, _ = skinny._config(n, k, gated, norm, w_bytes, block_t, dev)
        assert 1 <= stages <= 4 and 16 <= block_k, (n, k, block_k, stages)
        if w_bytes == 4:  # float32: 16 x 32 tiles (an lm_head 128 rows), K split into parts >= 96 deep
            assert (block_n, block_k) == ((128, 32) if n >= 16384 and not gated else (16, 32)), (n, k)
            assert split == 1 or (-(-k // split) >= 96 and -(-n // 16) * (split - 1) < 2 * sms), (n, k, split)
        assert stages * ((2 if gated else 1) * block_n + block_t) * block_k * w_bytes <= budget, (n, k, w_bytes)
        if block_k >= k:  # one tile
            assert stages == 1 and k <= 1024 and n < 16384 and not gated and not (norm and block_t == 32), (n, k, norm)
        else:
            assert block_n == 16 or -(-n // block_n) * split >= sms // 2, (n, block_n)
    assert skinny._config(576, 576, False, False, 2, 16, DEV)[1:3] == (1024, 1)  # o_proj: one tile
    assert skinny._config(576, 1536, False, False, 2, 16, DEV)[0] == 16  # down_proj: 36 programs, not 9
    assert skinny._config(128256, 4096, False, True, 2, 16, DEV).stages == 3  # a wide lm_head: 3 stages
    # Qwen2.5's 1.5B and 0.5B off the TMA path: long rows split 4 ways, gated 32 x 128, a narrow head 64 rows
    assert tuple(skinny._config(1536, 8960, False, False, 2, 16, DEV))[:4] == (64, 128, 4, 4)
    assert tuple(skinny._config(896, 4864, False, False, 2, 32, DEV))[:4] == (32, 128, 4, 4)
    assert tuple(skinny._config(8960, 1536, True, True, 2, 16, DEV))[:2] == (32, 128)
    assert skinny._config(151936, 1536, False, True, 2, 16, DEV).block_n == 64
    assert skinny._config(151936, 1536, False, True, 2, 32, DEV).block_n == 128  # 32 tokens: as fast either way
    gpu = torch.device("cuda")
    assert skinny._config(960, 576, False, True, 4, 16, gpu).split == 5  # float32 qkv: 300 programs
    assert skinny._config(1536, 576, True, True, 4, 16, gpu).split == 3  # float32 gate_up: 288
    assert skinny._config(16384, 576, False, False, 4, 16, gpu).block_n == 64  # a float32 draft head: 256
    for (n, k, gated), w_bytes, block_t in itertools.product(shapes, (2, 4), (16, 32)):  # the TMA path's
        block_n, block_k, stages, split, _ = skinny._tma_config(n, k, gated, True, w_bytes, block_t, DEV)
        assert 1 <= stages <= 4 and split == 1 and block_k * w_bytes == (256 if gated else 512), (n, k)
        assert stages * ((2 if gated else 1) * block_n + block_t) * block_k * w_bytes <= budget, (n, k, w_bytes)
        # fp8 weights: the same bytes a stage, twice the columns; at 32 tokens only gated layers and heads;
        # layers on fewer 64-row programs than SMs split K on the half weights' boxes
        fp8 = skinny._tma_config(n, k, gated, True, 2, block_t, DEV, fp8=True)
        if fp8.split > 1:
            blocks = -(-n // 64)
            assert not gated and n < 16384 and blocks < sms and (2 * blocks <= sms or block_t == 32 and k >= 8192)
            assert tuple(fp8)[:2] == (64, 256) and fp8.split <= -(-k // 256), (n, k, fp8)
            assert fp8.stages * (64 + 2 * block_t) * 256 <= budget, (n, k)
            continue
        if block_t == 32 and not gated and n < 16384:
            assert fp8 == skinny._tma_config(n, k, gated, True, 2, block_t, DEV), (n, k)
            continue
        block_n, block_k, stages = fp8.block_n, fp8.block_k, fp8.stages
        assert block_n * block_k == (64 * 256 if gated else 64 * 512 if n < 16384 else 128 * 256), (n, k)
        assert 1 <= stages <= (2 if gated or n >= 16384 else 4), (n, k, stages)
        assert stages * ((2 if gated else 1) * block_n + 2 * block_t) * block_k <= budget, (n, k)


def test_narrow_fp8_layers_split_k_on_the_tma_path(monkeypatch):
    """fp8 layers on fewer 64-row programs than SMs (132 here) take K in parts on 64 x
    256 boxes: Llama-8B's o_proj and down_proj 4 ways at 16 and 32 tokens, Llama-70B's 2 ways
    at 32 tokens only; gated layers, lm_heads, half weights, wide enough layers and Llama-8B's qkv
    (96 programs, K 4096) do not."""
    from specserve.kernels import skinny, skinny_config

    monkeypatch.setattr(skinny_config, "device_limits", lambda device: (219 * 1024, 132))

    def split(n, k, block_t, gated=False, fp8=True):
        return skinny._tma_config(n, k, gated, False, 2, block_t, DEV, fp8=fp8).split

    assert [split(4096, k, t) for k in (4096, 14336) for t in (16, 32)] == [4] * 4
    assert [split(8192, k, t) for k in (8192, 28672) for t in (16, 32)] == [1, 2, 1, 2]
    assert split(4096, 4096, 16, fp8=False) == split(14336, 4096, 16, gated=True) == 1
    assert split(128256, 4096, 16) == split(10240, 8192, 32) == 1  # a head; 160 programs
    assert split(6144, 4096, 16) == split(6144, 4096, 32) == 1
    assert split(4096, 512, 16) == 2  # no part without a tile


def test_l2_prefetch_only_for_a_looped_contiguous_layer(monkeypatch):
    """The programs ask L2 for their later K tiles only where their loop reads them after
    the PDL wait: SmolLM2's gate_up at 32 tokens (bf16: 64 elements a 128-byte line; fp32:
    32, a wider model's: SmolLM2's float32 one splits K), not its one-tile o_proj, its split down_proj, its lm_head, a TMA launch or a
    weight whose rows are not contiguous."""
    from specserve.kernels import pdl, skinny, skinny_config

    monkeypatch.setattr(skinny_config, "device_limits", lambda device: (227 * 1024 - 8 * 1024, 132))

    def rule(n: int, k: int, gated: bool = False, norm: bool = False, w_bytes: int = 2, strides=None,
             tma: bool = False) -> int:
        cfg = skinny._config(n, k, gated, norm, w_bytes, 32, torch.device("cuda"))
        return pdl.prefetch_rule((2 * n if gated else n, k), strides or (k, 1), w_bytes, cfg.block_k, cfg.split, tma)

    assert rule(1536, 576, gated=True, norm=True) == 64
    assert rule(6144, 1536, norm=True, w_bytes=4) == 32  # a wider float32 model's qkv: looped
    assert rule(1536, 576, gated=True, norm=True, w_bytes=4) == 0  # float32 SmolLM2's: K split
    assert rule(576, 576) == 0  # one tile, fetched before the wait
    assert rule(576, 1536) == 0  # split K: each part one tile
    assert rule(49152, 576) == 0  # an lm_head
    assert rule(1536, 576, gated=True, norm=True, tma=True) == 0
    assert rule(1536, 576, gated=True, norm=True, strides=(1152, 1)) == 0  # a view of every other row


def test_few_token_path_takes_narrow_models_or_tma(monkeypatch):
    """One token always; 2-32 tokens up to 2048 wide (Llama-8B's 4096-wide verify was
    faster on cuBLAS than with pointer loads), at any width where TMA streams the weights
    or for an lm_head, unless SPECSERVE_SKINNY=0. TMA takes weights wider and taller than
    2048 with aligned rows; a wide qkv projection then runs apart from RoPE."""
    from specserve.kernels import skinny

    def takes(t: int, width: int) -> bool:
        with kernels.fused_kernels(True):
            return kernels.use_gemv(torch.zeros(t, width))

    assert takes(1, 4096) and takes(32, 576) and takes(2, 2048)
    assert not takes(16, 4096) and not takes(33, 576)
    with kernels.fused_kernels(True):  # an lm_head at any width
        assert kernels.use_gemv(torch.zeros(16, 4096), lm_head=True)
        assert not kernels.use_gemv(torch.zeros(33, 4096), lm_head=True)
    monkeypatch.setattr(kernels, "tma_enabled", lambda device: True)
    monkeypatch.setattr(skinny, "tma_enabled", lambda device: True)
    assert takes(16, 4096) and not takes(33, 4096)
    half = functools.partial(torch.zeros, dtype=torch.bfloat16)
    assert skinny.use_tma(half(4096, 14336)) and skinny.use_tma(half(14336, 4096))
    assert not skinny.use_tma(half(2048, 8192)) and not skinny.use_tma(half(8192, 576))
    assert not skinny.use_tma(half(14336, 4096).t().contiguous().t())  # the CPU's [in, out] layout
    assert not skinny.use_tma(torch.zeros(4096, 14336))  # float32 weights: pointer loads or cuBLAS
    assert kernels.qkv_rope_store(half(4, 4096), half(6144, 4096), 32, None, half(8, 8, 128),
                                  half(8, 8, 128), torch.zeros(4, dtype=torch.long)) is None
    monkeypatch.setenv("SPECSERVE_SKINNY", "0")
    assert takes(1, 576) and not takes(16, 576) and not takes(16, 4096)
