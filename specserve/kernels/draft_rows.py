"""The drafting pass's row bookkeeping kernels: `spec/tree/rows.py` dispatches here on CUDA.

Each `*_fused` launcher equals its torch reference in `spec/tree/rows.py` (the tests
compare them under TRITON_INTERPRET); see that module for what the rows are.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl_flags
from specserve.kernels.pdl import wait_and_release


@triton.jit
def _copy_row(src_ptr, dst_ptr, H, HB: tl.constexpr):
    """dst[:H] = src[:H] (in dst's dtype), HB columns at a time."""
    for h0 in range(0, H, HB):
        h = h0 + tl.arange(0, HB)
        tl.store(dst_ptr + h, tl.load(src_ptr + h, mask=h < H).to(dst_ptr.dtype.element_ty), mask=h < H)


@triton.jit
def _root_rows_kernel(HLogits, HNext, Last, Dst, XLast, Hidden, Buf, H, s_logits, s_next, s_buf,
                      HAS_NEXT: tl.constexpr, HB: tl.constexpr, USE_PDL: tl.constexpr):
    wait_and_release(USE_PDL)  # the rows are the draft forward's
    b = tl.program_id(0).to(tl.int64)
    r = tl.load(Last + b).to(tl.int64)
    _copy_row(HLogits + r * s_logits, XLast + b * H, H, HB)
    if HAS_NEXT:
        _copy_row(HNext + r * s_next, Hidden + b * H, H, HB)
        _copy_row(HNext + r * s_next, Buf + tl.load(Dst + b).to(tl.int64) * s_buf, H, HB)


def root_rows_fused(h_logits: torch.Tensor, h_next: torch.Tensor | None, last: torch.Tensor,
                    dst: torch.Tensor, buf: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """root_rows (spec/tree/rows.py) in one launch; CUDA tensors."""
    b, h = last.shape[0], h_logits.shape[1]
    assert h_logits.stride(1) == 1 and (h_next is None or (h_next.shape[1] == h and h_next.stride(1) == 1))
    assert h_next is None or buf is not None, "a hidden state needs its per-row buffer"
    x_last = torch.empty(b, h, dtype=h_logits.dtype, device=h_logits.device)
    hidden = torch.empty(b, h, dtype=h_next.dtype, device=h_next.device) if h_next is not None else None
    if b:
        _root_rows_kernel[(b,)](h_logits, h_next if h_next is not None else h_logits, last, dst, x_last,
                                hidden if hidden is not None else x_last, buf if buf is not None else x_last, h,
                                h_logits.stride(0), h_next.stride(0) if h_next is not None else 0,
                                buf.stride(0) if buf is not None else 0, HAS_NEXT=h_next is not None,
                                HB=min(1024, triton.next_power_of_2(h)), num_warps=4, **pdl_flags(last.device))
    return x_last, hidden



@triton.jit
def _fan_out_kernel(Rows, Tail, States, RowsK, TailK, Pos, StatesK, H, D,
                    K: tl.constexpr, KB: tl.constexpr, DB: tl.constexpr, HAS_STATES: tl.constexpr,
                    HB: tl.constexpr, USE_PDL: tl.constexpr):
    wait_and_release(USE_PDL)  # the tail starts may be the kernel before's
    b = tl.program_id(0).to(tl.int64)
    bk = tl.program_id(0) * K  # this request's first branch; B*k branches a depth row
    n_branches = tl.num_programs(0) * K
    j = tl.arange(0, KB)
    live = j < K
    row, tail = tl.load(Rows + b), tl.load(Tail + b)
    tl.store(RowsK + bk + j, row + j * 0, mask=live)
    tl.store(TailK + bk + j, tail + j * 0, mask=live)
    d = tl.arange(0, DB)
    tl.store(Pos + d[:, None] * n_branches + bk + j[None, :], tail + d[:, None] + j[None, :] * 0,
             mask=(d < D)[:, None] & live[None, :])
    if HAS_STATES:
        for i in tl.static_range(K):
            _copy_row(States + b * H, StatesK + (bk + i).to(tl.int64) * H, H, HB)


def fan_out_fused(rows: torch.Tensor, tail: torch.Tensor, states: torch.Tensor | None, k: int,
                  depths: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """fan_out (spec/tree/rows.py) in one launch; CUDA tensors."""
    b, dev = rows.shape[0], rows.device
    rows, tail = rows.contiguous(), tail.contiguous()
    states = states.contiguous() if states is not None else None
    rows_k = torch.empty(b * k, dtype=rows.dtype, device=dev)
    tail_k = torch.empty(b * k, dtype=tail.dtype, device=dev)
    positions = torch.empty(depths, b * k, dtype=tail.dtype, device=dev)
    states_k = torch.empty(b * k, states.shape[1], dtype=states.dtype, device=dev) if states is not None else None
    h = states.shape[1] if states is not None else 1
    if b:
        _fan_out_kernel[(b,)](rows, tail, states if states is not None else rows, rows_k, tail_k, positions,
                              states_k if states_k is not None else rows_k, h, depths, K=k,
                              KB=max(2, triton.next_power_of_2(k)), DB=max(2, triton.next_power_of_2(depths)),
                              HAS_STATES=states is not None, HB=min(1024, triton.next_power_of_2(h)),
                              num_warps=4, **pdl_flags(dev))
    return rows_k, tail_k, positions, states_k
