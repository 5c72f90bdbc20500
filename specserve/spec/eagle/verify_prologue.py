"""The start of a pipelined EAGLE step (step_graphs.py): one launch on CUDA (kernels/verify_prologue.py).

Before its verify forward a step graph (1) sends padding requests to position 0, (2)
writes the verify slots into the request-to-token table at kv_len.., (3) derives each
node's RoPE position kv_len + depth from the tree's ancestor mask and (4) hands the
attention backend its prefix lengths as int32. With torch ops that is ten small launches
and a copy, each near its latency floor, in a step that launches bound at batch 1; here one
program per request does all of it:

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

from specserve import kernels
from specserve.cache.req_table import ReqToTokenTable


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
    from specserve.kernels.verify_prologue import verify_prologue_fused  # imports triton: CUDA only

    return verify_prologue_fused(rows, kv_len, offsets, slots, mask, table, pad_row, prefix32, row_start)


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
