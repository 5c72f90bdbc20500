"""The pipelined step's prologue kernel: `spec/eagle/verify_prologue.py` dispatches here on CUDA.

`verify_prologue_fused` equals `verify_prologue_torch` (the tests compare them under
TRITON_INTERPRET); see `spec/eagle/verify_prologue.py` for what it writes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.cache.req_table import ReqToTokenTable
from specserve.kernels import pdl_flags
from specserve.kernels.pdl import wait_and_release


@triton.jit
def _prologue_kernel(Rows, KvLen, Offsets, Slots, Mask, Table, stride_table, Pos, Prefix32, RowStart, pad_row,
                     N: tl.constexpr, BLOCK_N: tl.constexpr, HAS_PREFIX: tl.constexpr, HAS_ROW_START: tl.constexpr,
                     USE_PDL: tl.constexpr):
    wait_and_release(USE_PDL)  # kv_len and the trees are the previous step's writes
    p = tl.program_id(0)
    row = tl.load(Rows + p)
    is_pad = row == pad_row
    kv = tl.where(is_pad, 0, tl.load(KvLen + p))
    tl.store(KvLen + p, kv)
    tl.store(Offsets + p, kv * 0, mask=is_pad)
    i = tl.arange(0, BLOCK_N)
    live = i < N
    tl.store(Table + row * stride_table + kv + i, tl.load(Slots + p * N + i, mask=live), mask=live)
    m = tl.load(Mask + p * N * N + i[:, None] * N + i[None, :], mask=live[:, None] & live[None, :], other=0)
    depth = tl.sum(m.to(tl.int64), axis=1) - 1
    tl.store(Pos + p * N + i, kv + depth, mask=live)
    if HAS_PREFIX:
        tl.store(Prefix32 + p, kv.to(tl.int32))
    if HAS_ROW_START:  # [rows (B), kv_len (B)]: B programs
        tl.store(RowStart + p, row)
        tl.store(RowStart + tl.num_programs(0) + p, kv)


def verify_prologue_fused(rows: torch.Tensor, kv_len: torch.Tensor, offsets: torch.Tensor,
                          slots: torch.Tensor, mask: torch.Tensor, table: ReqToTokenTable, pad_row: int,
                          prefix32: torch.Tensor | None = None, row_start: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """verify_prologue (spec/eagle/verify_prologue.py) in one launch; CUDA tensors."""
    b, n = slots.shape
    assert mask.shape == (b, n, n) and rows.shape == kv_len.shape == offsets.shape == (b,)
    assert all(t.is_contiguous() for t in (rows, kv_len, offsets, slots, mask)) and table.table.stride(1) == 1
    positions = torch.empty(b * n, dtype=torch.int64, device=slots.device)
    _prologue_kernel[(b,)](rows, kv_len, offsets, slots, mask.view(torch.uint8), table.table, table.table.stride(0),
                           positions, prefix32 if prefix32 is not None else kv_len,
                           row_start if row_start is not None else kv_len, pad_row, N=n,
                           BLOCK_N=triton.next_power_of_2(n), HAS_PREFIX=prefix32 is not None,
                           HAS_ROW_START=row_start is not None, num_warps=1, **pdl_flags(slots.device))
    return positions
