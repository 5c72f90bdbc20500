"""Launch shapes of the few-token kernel (`skinny.py`, and `qkv_rope.py` on its tiles): a
launch's tiles, pipeline stages and K split (`Config`, `config`, `tma_config`, read from a
sweep of Llama-8B's and SmolLM2's layer shapes), the device limits they respect, and the
scratch a split launch sums its parts in (`split_buffers`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton


class Config(NamedTuple):
    """A few-token launch's shape: weight rows and K columns per tile, pipeline stages,
    the programs K is split over (1: none; `split_sum`) and warps a program."""
    block_n: int
    block_k: int
    stages: int
    split: int = 1
    warps: int = 4


_COUNTS: dict[torch.device, torch.Tensor] = {}  # device -> split_sum's counts, all 0 between launches
MAX_ROW_BLOCKS = 4096  # row blocks of a split launch


def split_buffers(device: torch.device, row_blocks: int, cfg: Config,
                  block_t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(parts, counts) for `split_sum`: fp32 scratch [row_blocks, split, 3, BLOCK_N, BLOCK_T]
    (without a split, the counts again: never dereferenced, and no allocation a launch)
    and the device's counts, one per row block. The counts are one zeroed buffer per
    device, allocated once so that CUDA graphs keep its address; every launch leaves them 0."""
    if cfg.split == 1:
        return counts(device), counts(device)
    assert row_blocks <= MAX_ROW_BLOCKS, row_blocks
    part = torch.empty(row_blocks * cfg.split * 3 * cfg.block_n * block_t, dtype=torch.float32, device=device)
    return part, counts(device)


def counts(device: torch.device) -> torch.Tensor:
    if device not in _COUNTS:
        _COUNTS[device] = torch.zeros(MAX_ROW_BLOCKS, dtype=torch.int32, device=device)
    return _COUNTS[device]


_LIMITS: dict[int | None, tuple[int, int]] = {}  # device index -> (shared memory a program may use, SMs)


def device_limits(device: torch.device) -> tuple[int, int]:
    """(shared memory bytes a program may use, less 8 KB of Triton's own, SM count), read once per device."""
    if device.type != "cuda":
        return 1 << 20, 1  # the interpreter has no limit
    if device.index not in _LIMITS:
        props = torch.cuda.get_device_properties(device)
        smem = getattr(props, "shared_memory_per_block_optin", 99 * 1024) - 8 * 1024
        _LIMITS[device.index] = smem, props.multi_processor_count
    return _LIMITS[device.index]


def config(n: int, k: int, gated: bool, norm: bool, w_bytes: int, block_t: int,
            device: torch.device) -> Config:
    """The launch's Config; BLOCK_K >= k means one tile holds the whole row. float32
    weights on a GPU take `f32_config`'s; the rest of this is half and fp8 weights'.

    Rows up to 1024 wide that are not gated take one tile, 64 rows a program with the
    exact norm (16 tokens), 16 without a norm, unless the layer is an lm_head (16384 rows
    or more: it takes the general tiles below) or normed at 32 tokens (looping 16 x 256
    deep with the deferred norm is faster there than one tile). For a narrow model's qkv
    and o_proj at 16 tokens one tile is faster than the loop.
    Otherwise the tiles of a sweep of the plain kernel over Llama-8B's shapes at 16 and 32
    tokens: 128 rows for the widest layers, 64 for inputs up to 4096 wide, 32 for longer
    rows (down_proj's 14336); half as deep a K tile for float32. Each pipeline stage holds
    one weight tile (two when gated) and one x tile; as many stages as fit the device's
    shared memory (4 stages of gate_up's 64x256 pair need 296 KB), up to 4 (a fourth stage
    helps narrow gated and long-row layers at 32 tokens and costs nothing elsewhere), 3 for
    a wide model's lm_head. A narrow model's lm_head at 32 tokens takes 64-deep tiles,
    which stream it faster than 128-deep ones. Narrow layers (SmolLM2's 576 rows) halve
    BLOCK_N down to tl.dot's 16 until there are about half as many programs as SMs: a
    handful of programs cannot stream even a small weight. A row deeper than 1024 on
    fewer than half as many 16-row programs as SMs is split into 512-deep parts, one tile
    each (SmolLM2's down_proj, at verify and drafting token counts alike: no unsplit
    configuration streams it as fast); at 32 tokens it takes 32 x 256 tiles split 6 ways.
    From a sweep of SmolLM2's shapes at 8-32 tokens: a narrow lm_head (16384 rows or more,
    up to 1024 wide) takes 64 x 64 tiles on 2 warps at any token count, and a gated layer
    left on 16-row tiles takes 128-deep tiles on 2 warps up to 16 tokens, 64-deep at 32."""
    smem, sms = device_limits(device)
    if w_bytes == 4 and device.type == "cuda":  # the interpreter keeps the larger tiles: fewer programs
        return f32_config(n, k, gated, sms)
    if not gated and n >= 16384 and k <= 1024:  # a narrow model's lm_head (SmolLM2's, its draft heads')
        return Config(64, 64, 4, warps=2)
    mid = _mid_width(n, k, gated, block_t, w_bytes, smem)
    if mid is not None:
        return mid
    if not gated and k > 1024 and triton.cdiv(n, 16) < sms // 2 and n < 16384:  # SmolLM2's down_proj
        return Config(16, 512, 1, triton.cdiv(k, 512)) if block_t == 16 else Config(32, 256, 4, triton.cdiv(k, 256))
    if not gated and k <= 1024 and n < 16384 and (block_t == 16 or not norm):
        block_n, block_k = (64 if norm else 16), max(16, triton.next_power_of_2(k))
        if (block_n + block_t) * block_k * w_bytes <= smem:
            return Config(block_n, block_k, 1)
    block_n = 128 if n >= 16384 and not gated else 64 if k <= 4096 else 32
    while block_n > 16 and triton.cdiv(n, block_n) < sms // 2:
        block_n //= 2
    block_k = (128 if block_n == 128 else 256) * 2 // w_bytes
    if block_n == 128 and block_t == 32 and k <= 2048:  # a narrow model's lm_head: faster than 128 deep
        block_k = 64 * 2 // w_bytes
    warps = 4
    if gated and block_n == 16:  # a narrow model's gate_up (SmolLM2's): shallower tiles, 2 warps at 16 tokens
        block_k, warps = (128, 2) if block_t == 16 else (64, 4)
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    stage = ((2 if gated else 1) * block_n + block_t) * block_k * w_bytes
    # A wide model's lm_head: 3 stages, which stream it faster than 4
    most = 3 if n >= 16384 and k > 2048 and not gated else 4
    return Config(block_n, block_k, max(1, min(most, smem // stage)), warps=warps)


def _mid_width(n: int, k: int, gated: bool, block_t: int, w_bytes: int, smem: int) -> Config | None:
    """Qwen2.5's 0.5B and 1.5B layers off the TMA path (hidden 896 and 1536), from a sweep
    at 4 tokens (docs/benchmarks.md): a down_proj with rows past 2048 on 32 or 64 rows a
    program, 128 deep, K split 4 ways (the 16-row tiles leave its 896 or 1536 rows on too
    few programs, and one 512-deep tile a part is slower); a gated layer with rows 1025 to
    4096 deep on 32 rows by 128 (half the 64 x 256 tiles); a narrow lm_head (rows up to
    2048) at up to 16 tokens on 64 rows a program. None: the general tiles."""
    if w_bytes != 2:
        return None
    if not gated and k > 2048 and n <= 2048:
        return Config(64 if n >= 1024 else 32, 128, 4, 4)
    if gated and 1024 < k <= 4096:
        return Config(32, 128, max(1, min(4, smem // ((2 * 32 + block_t) * 128 * w_bytes))))
    if not gated and n >= 16384 and 1024 < k <= 2048 and block_t == 16:
        return Config(64, 128, max(1, min(4, smem // ((64 + block_t) * 128 * w_bytes))))
    return None


def f32_config(n: int, k: int, gated: bool, sms: int) -> Config:
    """float32 layers (3xTF32 products, `skinny._dot`): 16 rows a program on 2 warps, 32
    columns a tile, K split until there are about twice as many programs as SMs, each
    part at least 96 columns deep; an lm_head takes 128 rows a program in 3 stages on 4
    warps, 64 where 128 would leave fewer programs than twice the SMs (a draft head).

    From a sweep of SmolLM2's shapes and its EAGLE-3 head's at 8 and 16 tokens: wider row
    blocks, deeper tiles, more warps and fewer programs are slower, and one tile of a
    whole row spills its registers."""
    if n >= 16384 and not gated:
        return Config(128 if n >= 256 * sms else 64, 32, 3)
    split = max(1, min(triton.cdiv(k, 96), triton.cdiv(2 * sms, triton.cdiv(n, 16))))
    return Config(16, 32, 2 if split > 1 else 4, split, warps=2)


def tma_config(n: int, k: int, gated: bool, norm: bool, w_bytes: int, block_t: int,
               device: torch.device, fp8: bool = False) -> Config:
    """The launch's Config on the TMA path (`use_tma`): 64 rows a program, boxes 256
    columns deep (128 gated: two boxes a stage), as many stages as fit up to 4.

    From a sweep of Llama-8B's shapes at 16 tokens against cuBLAS's plain product and the
    pointer-load kernel: with these boxes the fused qkv, o_proj, down_proj and lm_head run
    at least as fast as both; 32 or 128 rows a program, or 64-deep boxes, are slower.
    Fewer stages can speed a normed layer timed alone, yet slow the whole verify graph, so
    every layer takes as many as fit, up to 4.

    fp8 weights (`fp8`; w_bytes is then x's element size, as `skinny.tile_bytes` gives it)
    take boxes twice as deep, the same bytes a stage as a half weight's: at up to 16 tokens
    512 columns; gated 256 in 2 stages; an lm_head (16384 rows or more) 128 rows by 256 in 2
    stages. At 32 tokens only the gated layers and the lm_head take theirs; the others are
    fastest on the half weights' boxes. From sweeps of the same shapes at 16 and 32 tokens
    (docs/benchmarks.md).

    Narrow fp8 layers split K over programs instead (`_fp8_split`): at 64 rows a program
    they have too few programs to widen their tiles as fast as the bytes arrive."""
    smem, sms = device_limits(device)
    split = _fp8_split(n, k, gated, block_t, sms) if fp8 else 1
    if split > 1:
        stage = 64 * 256 + block_t * 256 * w_bytes
        return Config(64, 256, max(1, min(4, smem // stage)), split)
    if fp8 and (block_t == 16 or gated or n >= 16384):
        block_n, block_k = (128, 256) if n >= 16384 and not gated else (64, 256 if gated else 512)
        stage = (2 if gated else 1) * block_n * block_k + block_t * block_k * w_bytes
        most = 2 if gated or block_n == 128 else 4
        return Config(block_n, block_k, max(1, min(most, smem // stage)))
    block_n, block_k = 64, (128 if gated else 256) * 2 // w_bytes
    stage = ((2 if gated else 1) * block_n + block_t) * block_k * w_bytes
    return Config(block_n, block_k, max(1, min(4, smem // stage)))


def _fp8_split(n: int, k: int, gated: bool, block_t: int, sms: int) -> int:
    """The K split of an fp8 layer on the TMA path (64 x 256 boxes; 1: none). Each program
    widens its tiles to fp16 before the dot, so a layer on fewer 64-row programs than SMs
    is bound by its programs' arithmetic, not the bytes. At most half as many programs as
    SMs (Llama-8B's o_proj and down_proj): K in 4 parts at 16 and 32 tokens. Fewer than the
    SMs with K of 8192 or more (Llama-70B's): 2 parts at 32 tokens only. Narrower K there
    (Llama-8B's qkv), gated layers (their rows twice over) and lm_heads (16384 rows or
    more) stay whole; the sweep behind each choice is in docs/benchmarks.md."""
    blocks = triton.cdiv(n, 64)
    if gated or n >= 16384 or blocks >= sms:
        return 1
    split = 4 if 2 * blocks <= sms else 2 if block_t == 32 and k >= 8192 else 1
    return max(1, min(split, triton.cdiv(k, 256)))
