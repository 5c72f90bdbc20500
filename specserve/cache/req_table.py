"""The request-to-token table: row r, column p holds the slot of request r's token p.

Rows are handed out to running requests. Committing accepted draft tokens or sharing a
cached prefix is a write into this table, never a KV copy. The table lives on the model's
device so attention kernels can read it directly, and a twin on the host holds every
request's committed positions [0, kv_len), so releasing a request reads no device memory:
such a read waits for all queued GPU work, so a request ending inside a pipelined step
would stall the host for the whole step in flight. Every write goes to both, but those the device makes alone (verify
slots past kv_len, the in-graph commit of a pipelined step), whose committed part the host
writes with `mirror` when it commits them.

One row past the requests' (`pad_row`) is never handed out: the padding requests of a
CUDA graph captured for more requests than it serves (spec/eagle/step_graphs.py) read and
write it, so they never touch a real request's positions.
"""
from __future__ import annotations

import torch

from specserve.core.h2d import h2d_many


def slots_at(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The slots at flat indices (row * stride + position) into `table` [rows, context], on
    its device; -1 gives the scratch slot 0. Nothing is read back (spec/standalone/proposer.py's
    drafting steps, whose slots the host does not know)."""
    return torch.where(index >= 0, table.view(-1)[index.clamp_min(0)], 0)


class ReqToTokenTable:
    def __init__(self, max_reqs: int, max_context: int, device: torch.device | str) -> None:
        self.max_reqs = max_reqs
        self.max_context = max_context
        self.pad_row = max_reqs  # the graphs' padding requests' row (never handed out)
        self.table = torch.zeros(max_reqs + 1, max_context, dtype=torch.int64, device=device)
        # committed positions on the host; a copy even when the table lives there, so the
        # CPU tests check the twin (KVManager.check_twin)
        self.host = torch.zeros(max_reqs + 1, max_context, dtype=torch.int64)
        self._free_rows = list(range(max_reqs))
        self._cols: dict[int, torch.Tensor] = {}  # arange(n) on the device, per block width

    @property
    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        assert row not in self._free_rows, f"row {row} freed twice"
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """table[row, start:start+len(slots)] = slots (a CPU tensor)."""
        self.table[row, start:start + slots.numel()] = slots.to(self.table.device, non_blocking=True)
        self.host[row, start:start + slots.numel()] = slots

    def write_many(self, rows: list[int], starts: list[int], slots: list[torch.Tensor] | list[list[int]]) -> None:
        """table[rows[i], starts[i]:starts[i]+len(slots[i])] = slots[i] for every i (CPU
        tensors or int lists), as one index write with one host->device copy (per-row
        writes cost a copy each)."""
        lens = [len(s) for s in slots]
        if not sum(lens):
            return
        if len(rows) == 1:  # one row (batch 1): two slice writes, not an index write's tensors
            self.write(rows[0], starts[0], torch.as_tensor(slots[0], dtype=torch.int64))
            return
        r, c, flat = self._flat_cells(rows, starts, slots, lens)
        dev_r, dev_c, dev_s = h2d_many([r, c, flat], self.table.device)
        self.table[dev_r, dev_c] = dev_s
        self.host[r, c] = flat

    def mirror(self, rows: list[int], starts: list[int], slots: list[list[int]]) -> None:
        """The host twin of a write the device made itself (`write_many`'s arguments)."""
        lens = [len(s) for s in slots]
        if len(rows) == 1 and lens[0]:  # one row (batch 1): one slice write, not four tensor ops
            self.host[rows[0], starts[0]:starts[0] + lens[0]] = torch.as_tensor(slots[0], dtype=torch.int64)
            return
        if sum(lens):
            r, c, flat = self._flat_cells(rows, starts, slots, lens)
            self.host[r, c] = flat

    @staticmethod
    def _flat_cells(rows: list[int], starts: list[int], slots: list[torch.Tensor] | list[list[int]],
                    lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row, column, slot) of every cell of a `write_many`, as CPU int64 tensors."""
        r = torch.tensor([row for row, n in zip(rows, lens) for _ in range(n)], dtype=torch.int64)
        c = torch.tensor([start + i for start, n in zip(starts, lens) for i in range(n)], dtype=torch.int64)
        flat = torch.cat(slots).to(torch.int64) if isinstance(slots[0], torch.Tensor) \
            else torch.tensor([x for s in slots for x in s], dtype=torch.int64)
        return r, c, flat

    def write_block(self, rows: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> None:
        """table[rows[b], starts[b] + i] = slots[b, i]: rows and starts [B] and slots [B, N]
        on the table's device (starts may be known there only: a pipelined step). One
        index_copy_ over the flat table: a 2-D index_put costs several times its host time."""
        n = slots.shape[1]
        cols = self._cols.get(n)
        if cols is None:
            cols = self._cols[n] = torch.arange(n, device=self.table.device)
        flat = ((rows * self.table.stride(0) + starts)[:, None] + cols).reshape(-1)
        self.table.view(-1).index_copy_(0, flat, slots.reshape(-1))

    def write_each(self, rows: list[int], cols: list[int], slots: torch.Tensor) -> None:
        """table[rows[i], cols[i]] = slots[i]: one position per row (a decode step), one
        copy and one index_copy_ over the flat table (a 2-D index_put costs several times
        its host time)."""
        stride = self.table.stride(0)
        cells = torch.tensor([r * stride + c for r, c in zip(rows, cols)], dtype=torch.int64)
        flat, dev_s = h2d_many([cells, slots], self.table.device)
        self.table.view(-1).index_copy_(0, flat, dev_s)
        self.host.view(-1)[cells] = slots

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """The slots of committed positions [start, end) of a row (below its kv_len), as a
        CPU int64 tensor of its own (never a view of the table, whose row is reused once the
        request is released). From the host twin: no wait for the GPU."""
        return self.host[row, start:end].clone()
