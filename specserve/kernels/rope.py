"""RoPE (rotate-half convention) on queries and keys together, in one launch.

Same tables and formula as `specserve.models.rope.apply_rope`:
  out = x * cos + roll(x, D/2) * sin        (sin's first half negated: signed sin)
roll(x, D/2)[d] = x[(d + D/2) % D], so each program loads its head row twice. Each
product and the sum are rounded to the output dtype, as torch's three elementwise ops
do (in fp32 the compiler may contract to an FMA: ~1 ulp). One program per (token, head),
per token for `rope_store_kv`; x [T, heads, D] may be a strided view (last dim
contiguous); cos/sin [T, 1, D] or [T, D].
The output is a new contiguous [T, heads, D].

`rope_store_kv` does one attention layer's RoPE and KV-cache write in one launch: from
the fused projection qkv [T, H + 2 kvH, D] it rotates the queries into a new [T, H, D]
and the keys straight into the cache rows of the tokens' slots, and copies the values
there (rotate, then round to the cache dtype: what apply_rope and then the pool's index
write give). Per layer that is one launch where the torch path takes three. An fp8 cache
stores x / scale as `KVPool.write` does (`to_cache`; cache/kv_pool.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.cache.kv_pool import FP8_MAX, inverse_scale, is_fp8
from specserve.kernels import pdl_flags
from specserve.kernels.pdl import wait_and_release

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def to_cache(y, cache, inv_scale, FP8: tl.constexpr):
    """y as `cache` stores it: rounded to its dtype, or for an fp8 cache (FP8) y times the
    float32 reciprocal of its scale, saturated to +-448 and rounded to nearest even: the
    bytes `cache.kv_pool.quantize` writes."""
    if FP8:
        y = tl.minimum(tl.maximum(y.to(tl.float32) * inv_scale, -_FP8_MAX), _FP8_MAX)
    return y.to(cache.dtype.element_ty)


@triton.jit
def _rotated(base, cos_ptr, sin_ptr, t, sc, d, mask, D, HALF_D: tl.constexpr, out_ptr):
    """x * cos + roll(x, D/2) * sin for the head row at `base` (token t), each product and
    the sum rounded to out_ptr's dtype as torch's elementwise ops do."""
    ty = out_ptr.dtype.element_ty
    x = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
    xr = tl.load(base + (d + HALF_D) % D, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * sc + d, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * sc + d, mask=mask, other=0.0).to(tl.float32)
    a = (x * c).to(ty).to(tl.float32)
    b = (xr * s).to(ty).to(tl.float32)
    return (a + b).to(ty)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, sx0, sx1, sc, D,
                 HALF_D: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t, h = pid // heads, pid % heads
    d = tl.arange(0, BLOCK)
    mask = d < D
    y = _rotated(x_ptr + t * sx0 + h * sx1, cos_ptr, sin_ptr, t, sc, d, mask, D, HALF_D, out_ptr)
    tl.store(out_ptr + pid * D + d, y, mask=mask)


def _table_2d(t: torch.Tensor, tokens: int) -> torch.Tensor:
    t = t.reshape(tokens, -1)  # [T, 1, D] -> [T, D]: a view for lookup()'s output
    return t if t.stride(-1) == 1 else t.contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    assert x.dim() == 3 and x.shape[-1] % 2 == 0, x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens, heads, dim = x.shape
    cos, sin = _table_2d(cos, tokens), _table_2d(sin, tokens)
    assert cos.shape == sin.shape == (tokens, dim) and cos.stride(0) == sin.stride(0), (cos.shape, sin.shape)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    if tokens * heads == 0:
        return out
    _rope_kernel[(tokens * heads,)](x, cos, sin, out, heads, x.stride(0), x.stride(1), cos.stride(0), dim,
                                    HALF_D=dim // 2, BLOCK=triton.next_power_of_2(dim), num_warps=1)
    return out


@triton.jit
def _rope_store_kernel(x_ptr, cos_ptr, sin_ptr, q_ptr, k_cache, v_cache, slots_ptr, H, KVH,
                       sx0, sx1, sc, sk0, sk1, sv0, sv1, D, k_inv, v_inv, HALF_D: tl.constexpr, BLOCK: tl.constexpr,
                       BLOCK_H: tl.constexpr, KV_FP8: tl.constexpr, USE_PDL: tl.constexpr):
    """One token's heads [BLOCK_H, BLOCK] a program: H queries, then kvH keys, then kvH
    values. One program per (token, head) would give a large verify at a large batch tens
    of thousands of programs of a single head row each, too little work to pay for their
    scheduling."""
    wait_and_release(USE_PDL)
    t = tl.program_id(0)
    j = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK)[None, :]
    in_d = d < D
    mask = (j < H + 2 * KVH) & in_d
    base = x_ptr + t * sx0 + j * sx1
    # rotated as `_rotated` does (values too, then dropped: they are copied as loaded)
    ty = q_ptr.dtype.element_ty
    x = tl.load(base + d, mask=mask, other=0.0)
    xr = tl.load(base + (d + HALF_D) % D, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * sc + d, mask=in_d, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * sc + d, mask=in_d, other=0.0).to(tl.float32)
    y = ((x.to(tl.float32) * c).to(ty).to(tl.float32) + (xr * s).to(ty).to(tl.float32)).to(ty)
    slot = tl.load(slots_ptr + t)
    tl.store(q_ptr + (t * H + j) * D + d, y, mask=mask & (j < H))
    is_k = (j >= H) & (j < H + KVH)
    tl.store(k_cache + slot * sk0 + (j - H) * sk1 + d, to_cache(y, k_cache, k_inv, KV_FP8), mask=mask & is_k)
    tl.store(v_cache + slot * sv0 + (j - H - KVH) * sv1 + d, to_cache(x, v_cache, v_inv, KV_FP8),
             mask=mask & (j >= H + KVH))


def rope_store_kv(qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, *, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> torch.Tensor:
    """qkv [T, heads + 2 kvH, D] (last dim contiguous) -> rotated queries [T, heads, D];
    rotated keys and the values stored at k_cache/v_cache[slots[t]] ([slots, kvH, D]),
    divided by k_scale / v_scale in an fp8 cache."""
    assert qkv.dim() == 3 and qkv.stride(-1) == 1 and qkv.shape[-1] % 2 == 0, qkv.shape
    tokens, total, dim = qkv.shape
    kv_heads = (total - heads) // 2
    assert total == heads + 2 * kv_heads and k_cache.shape[1:] == (kv_heads, dim) == v_cache.shape[1:]
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1 and slots.shape == (tokens,)
    cos, sin = _table_2d(cos, tokens), _table_2d(sin, tokens)
    assert cos.shape == sin.shape == (tokens, dim) and cos.stride(0) == sin.stride(0), (cos.shape, sin.shape)
    q = torch.empty(tokens, heads, dim, dtype=torch.promote_types(qkv.dtype, cos.dtype), device=qkv.device)
    if tokens == 0:
        return q
    block, block_h = triton.next_power_of_2(dim), triton.next_power_of_2(total)
    _rope_store_kernel[(tokens,)](qkv, cos, sin, q, k_cache, v_cache, slots, heads, kv_heads,
                                  qkv.stride(0), qkv.stride(1), cos.stride(0), k_cache.stride(0),
                                  k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), dim,
                                  inverse_scale(k_scale), inverse_scale(v_scale),
                                  HALF_D=dim // 2, BLOCK=block, BLOCK_H=block_h, KV_FP8=is_fp8(k_cache.dtype),
                                  num_warps=max(1, min(8, block * block_h // 256)), **pdl_flags(qkv.device))
    return q
