"""STANDALONE's catch-up drafted ahead: the device bookkeeping between a verify's walk and its read-back.

A pipelined step (spec/pipeline.py) launches the next verify before the host knows what
this one committed, so the draft's catch-up is built on the device from the greedy walk.
Per request, with K the step's kv_len (its root's position) and a the accepted drafts:
  * the table row gets the committed positions' slots K .. K + a (the root's and the
    accepted nodes' verify slots), as the host's commit would write them;
  * position K' = K + a + 1 (the bonus token, the next root) has no slot yet (the next
    verify allocates it), so it points at the row's root slot, a slot of the draft's pool
    past the target's (`root_slot`): the draft's KV of the next root lands there, the
    target never reads it (the next verify writes its own slot over that table cell first);
  * the catch-up feeds the step's root, the accepted nodes and the bonus at K .. K'
    (a + 2 <= num_steps + 2 tokens), padded to L with table index -1 (the scratch slot 0).
The root is fed again though a drafting pass fed it already: that pass wrote its KV in
the root slot, not in the verify slot the root now has.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from specserve.spec.accept import GreedyWalk


class CatchUp(NamedTuple):
    """A catch-up built on the device: the extend graphs' inputs, and what it leaves."""

    inputs: list[torch.Tensor]  # [ids, positions, flat table indices, feature rows] [B*L] each, [rows, last] [B] each
    prefix: torch.Tensor  # [B] the position each request's catch-up starts at (its step's root's)
    kv_after: torch.Tensor  # [B] kv_len after the commit (the next root's position)
    roots: torch.Tensor  # [B] the next roots (the bonus tokens)


def catch_up_ahead(walk: GreedyWalk, slots: torch.Tensor, row_start: torch.Tensor, table: torch.Tensor,
                   root_slot0: int, length: int) -> CatchUp:
    """The commit's table writes and the catch-up's inputs (module docstring), with torch
    ops on the device: `walk` over full trees [B, N] whose slots are `slots` [B, N],
    row_start [2B] the requests' table rows then kv_lens before the verify, row r's root
    slot root_slot0 + r, `length` L > the trees' depth + 1."""
    b, dev = slots.shape[0], slots.device
    paths = walk.paths(length - 1)  # nodes and committed tokens [B, L - 1], lens = a + 1
    rows, start = row_start[:b], row_start[b:]
    col = torch.arange(length, device=dev)
    on_path = col[:-1] < paths.lens[:, None]
    cells = (rows[:, None].expand(b, length - 1), start[:, None] + col[:-1])
    table[cells] = torch.where(on_path, slots.gather(1, paths.nodes), table[cells])
    kv_after = start + paths.lens
    table[rows, kv_after] = rows + root_slot0
    fed = paths.lens + 1  # the step's root, then the committed tokens (the bonus last)
    ids = torch.cat([walk.tokens[:, :1], paths.tokens], 1)  # 0 past the committed tokens
    pos = start[:, None] + col
    flat = torch.where(col < fed[:, None], rows[:, None] * table.stride(0) + pos, -1)
    last = torch.arange(b, device=dev) * length + fed - 1
    bonus = paths.tokens.gather(1, (paths.lens - 1)[:, None])[:, 0]
    inputs = [ids.reshape(-1), pos.reshape(-1), flat.reshape(-1), torch.zeros_like(flat).view(-1), rows, last]
    return CatchUp(inputs, start, kv_after, bonus)
