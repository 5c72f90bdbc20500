"""The start of a pipelined EAGLE step (step_graphs.py) in one launch on CUDA.

Before its verify forward a step graph (1) sends padding requests to position 0, (2)
writes the verify slots into the request-to-token table at kv_len.., (3) derives each
node's RoPE position kv_len + depth from the tree's ancestor mask and (4) hands the
attention backend its prefix lengths as int32. With torch ops that is ten small launches
and a copy, each about its latency floor (~1.5-2.5 us on an H100) in a step of ~1 ms at
batch 1; here one program per request does all of it:

  row == pad_row (a padding request): kv_len = 0 and its output-index offset = 0;
  table[row, kv_len + i] = slots[b, i]                  for i < N;
  positions[b, i] = kv_len + (sum_j mask[b, i, j]) - 1  (the mask holds node and ancestors);
  prefix32[b] = kv_len                                  (when the backend has such a buffer);
  row_start = [rows, kv_len]                            (when asked: the draft-ahead kernel's
                                                        input, which a cat launched after this).

`verify_prologue_torch` is the reference (CPU and tests); the kernel must equal it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve import kernels
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


def verify_prologue(rows: torch.Tensor, kv_len: torch.Tensor, offsets: torch.Tensor, slots: torch.Tensor,
                    mask: torch.Tensor, table: ReqToTokenTable, pad_row: int,
                    prefix32: torch.Tensor | None = None, row_start: torch.Tensor | None = None) -> torch.Tensor:
    """rows, kv_len and offsets [B] int64 (kv_len and offsets rewritten for padding
    requests), slots [B, N] int64, mask [B, N, N] bool: the table write and the verify's
    positions [B*N] int64 (module docstring); prefix32 [>= B] int32, when given, gets kv_len;
    row_start [2B] int64, when given, gets rows then kv_len (after the padding rewrite)."""
    assert row_start is None or (row_start.shape == (2 * rows.numel(),) and row_start.dtype == torch.int64)
    if not kernels.use_fused(kv_len):
        return verify_prologue_torch(rows, kv_len, offsets, slots, mask, table, pad_row, prefix32, row_start)
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


def verify_prologue_torch(rows: torch.Tensor, kv_len: torch.Tensor, offsets: torch.Tensor, slots: torch.Tensor,
                          mask: torch.Tensor, table: ReqToTokenTable, pad_row: int,
                          prefix32: torch.Tensor | None = None, row_start: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """verify_prologue with torch ops (its reference)."""
    pad = rows == pad_row
    kv_len.masked_fill_(pad, 0)
    offsets.masked_fill_(pad, 0)
    table.write_block(rows, kv_len, slots)
    if prefix32 is not None:
        prefix32[:kv_len.numel()].copy_(kv_len)
    if row_start is not None:
        torch.cat([rows, kv_len], out=row_start)
    return (kv_len[:, None] + mask.sum(-1, dtype=torch.int64) - 1).reshape(-1)
