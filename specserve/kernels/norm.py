"""RMSNorm and fused residual-add + RMSNorm: one Triton program per row.

Semantics match `specserve.models.layers.RMSNorm` in structure (not bit for bit: the
row reduction order differs):
  fp32:       out = x * rsqrt(mean(x^2) + eps) * w                 (all fp32)
  half types: out = w * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)
              (normalise in fp32, round, THEN scale by the half weight: HF's order;
              the product is rounded once, as torch's elementwise mul does)
The fused form first computes s = residual + x rounded to x's dtype (what
`residual + x` gives in torch; both must share a dtype), stores s as the new residual,
and normalises s.

Rows are the leading dims of x viewed as [A, B, N] (so strided [T, H, D] head slices,
e.g. Qwen3's q/k norm, need no copy); the last dim must be contiguous. Outputs are new
contiguous tensors: nothing is written in place, so a caller may keep the old residual
(EAGLE-3's aux states). One row fits one block: N <= 16384.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl_flags
from specserve.kernels.pdl import wait_and_release

_HALF = (torch.float16, torch.bfloat16)
MAX_N = 16384


@triton.jit
def _normalize(x, w_ptr, cols, mask, N, eps, HALF: tl.constexpr, DTYPE: tl.constexpr):
    """A row x (fp32, the x dtype's values) normalised and scaled as the module docstring says."""
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HALF:
        return w * (x * rstd).to(DTYPE).to(tl.float32)
    return x * rstd * w


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, n_inner, sx0, sx1, sr0, sr1, N, eps,
                     HAS_RES: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_and_release(USE_PDL)
    row = tl.program_id(0)
    i, j = row // n_inner, row % n_inner  # row of x viewed as [A, B, N]
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + i * sx0 + j * sx1 + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + i * sr0 + j * sr1 + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_out_ptr.dtype.element_ty)  # rounded as torch's `residual + x`
        tl.store(res_out_ptr + row * N + cols, s, mask=mask)
        x = s.to(tl.float32)
    out = _normalize(x, w_ptr, cols, mask, N, eps, HALF, x_ptr.dtype.element_ty)
    tl.store(out_ptr + row * N + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_pair_kernel(a_ptr, wa_ptr, b_ptr, wb_ptr, out_ptr, ids_ptr, sa, sb, N, V, eps,
                          HALF: tl.constexpr, BLOCK: tl.constexpr, GATHER: tl.constexpr, USE_PDL: tl.constexpr):
    """out[t] = cat(norm(a[t]; wa), norm(b[t]; wb)): program (t, 0) the first half, (t, 1) the
    second. GATHER: a is a table of V rows and the first half's row is a[ids[t]] (an id
    outside [0, V) reads a zero row, as embed.py's gather does)."""
    wait_and_release(USE_PDL)
    t = tl.program_id(0)
    second = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if second == 0:
        a_row = t.to(tl.int64)
        if GATHER:
            a_row = tl.load(ids_ptr + t + cols * 0).to(tl.int64)  # the id, once per column
            mask = mask & (a_row >= 0) & (a_row < V)
        x = tl.load(a_ptr + a_row * sa + cols, mask=mask, other=0.0).to(tl.float32)
        mask = cols < N
        w_ptr = wa_ptr
    else:
        x = tl.load(b_ptr + t * sb + cols, mask=mask, other=0.0).to(tl.float32)
        w_ptr = wb_ptr
    out = _normalize(x, w_ptr, cols, mask, N, eps, HALF, a_ptr.dtype.element_ty)
    tl.store(out_ptr + t * 2 * N + second * N + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] as a [A, B, N] view with a unit last stride (copies only if it must)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() == 3:
        return x
    return x.reshape(-1, 1, x.shape[-1])


def _out_dtype(x_dtype: torch.dtype, weight: torch.Tensor) -> torch.dtype:
    # torch: fp32 -> F.rms_norm(x, w) (fp32); half -> w * y_half (promotes with w's dtype)
    return torch.promote_types(x_dtype, weight.dtype) if x_dtype in _HALF else x_dtype


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    assert n <= MAX_N and weight.shape == (n,), (x.shape, weight.shape)
    x3 = _as_3d(x)
    out = torch.empty(x.shape, dtype=_out_dtype(x.dtype, weight), device=x.device)
    new_res, r3 = None, x3  # r3 unused without a residual
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, residual.dtype)
        r3 = _as_3d(residual)
        new_res = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x3.shape[0] * x3.shape[1]
    if rows == 0:
        return out, new_res
    _rms_norm_kernel[(rows,)](
        x3, r3, weight.contiguous(), out, new_res if new_res is not None else out, x3.shape[1],
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), n, eps,
        HAS_RES=residual is not None, HALF=x.dtype in _HALF, BLOCK=triton.next_power_of_2(n),
        num_warps=_num_warps(n), **pdl_flags(x.device))
    return out, new_res


def _num_warps(n: int) -> int:
    return 1 if n <= 256 else 4 if n <= 2048 else 8


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def rms_norm_pair(a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor,
                  eps: float, ids: torch.Tensor | None = None) -> torch.Tensor:
    """cat([rms_norm(a, wa), rms_norm(b, wb)], -1) for a, b [T, N] of one dtype, in one launch;
    with `ids` [T], a is a table [V, N] and the first half normalises a[ids] (an embedding
    gathered by the same launch)."""
    assert a.dim() == b.dim() == 2 and a.dtype == b.dtype, (a.shape, b.shape)
    assert (a.shape if ids is None else (ids.shape[0], a.shape[1])) == b.shape, (a.shape, b.shape)
    t, n = b.shape
    assert n <= MAX_N and wa.shape == wb.shape == (n,) and wa.dtype == wb.dtype, (wa.shape, wb.shape)
    a, b = (x if x.stride(-1) == 1 else x.contiguous() for x in (a, b))
    out = torch.empty(t, 2 * n, dtype=_out_dtype(a.dtype, wa), device=a.device)
    if t:
        _rms_norm_pair_kernel[(t, 2)](a, wa.contiguous(), b, wb.contiguous(), out, ids if ids is not None else out,
                                      a.stride(0), b.stride(0), n, a.shape[0], eps, HALF=a.dtype in _HALF,
                                      BLOCK=triton.next_power_of_2(n), GATHER=ids is not None,
                                      num_warps=_num_warps(n), **pdl_flags(a.device))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, new_res = _launch(x, residual, weight, eps)
    assert new_res is not None  # _launch returns the new residual whenever it is given one
    return out, new_res
