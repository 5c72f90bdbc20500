"""Verify and commit: one target forward over root + drafts, then keep the accepted KV.

Verify runs every request's tree as new tokens at positions seq_len + depth with the
tree mask (the attention backend's custom-mask path); there is no per-algorithm branch.
Commit keeps the slots of the root and the accepted nodes, in path order, at positions
kv_len, kv_len + 1, ... of the request's table row, and frees every other slot of the
step in the same pass: an index write, never a KV copy.
"""
from __future__ import annotations

import torch

from specserve.engine.batch import ScheduleBatch
from specserve.engine.kv_manager import KVManager
from specserve.engine.request import Req
from specserve.runner.forward_batch import ForwardMode
from specserve.spec.drafts import Drafts


def verify_batch(reqs: list[Req], drafts: Drafts, slots: list[torch.Tensor], full: bool = False) -> ScheduleBatch:
    """The VERIFY batch: request b contributes its valid nodes (a prefix of its row), or
    with `full` all N nodes (the shape a captured graph needs). Padding nodes hang off the
    root, no valid node attends to them, and their K/V go to the scratch slot 0."""
    counts = [drafts.num_nodes] * len(reqs) if full else drafts.valid.sum(1).tolist()
    depth = drafts.depths()
    masks = drafts.tree_mask()
    ids, positions, custom, out_slots = [], [], [], []
    for b, (req, n) in enumerate(zip(reqs, counts)):
        valid = int(drafts.valid[b].sum())
        assert bool(drafts.valid[b, :valid].all()), "valid nodes must form a prefix of the row"
        ids += drafts.tokens[b, :n].tolist()
        positions += (req.kv_len + depth[b, :n]).tolist()
        custom.append(masks[b, :n, :n])
        s = slots[b][:min(n, valid)]
        out_slots.append(torch.cat([s, s.new_zeros(n - s.numel())]) if n > s.numel() else s)
    return ScheduleBatch(ForwardMode.VERIFY, reqs, ids, torch.cat(out_slots),
                         [r.kv_len for r in reqs], counts, [True] * len(reqs),
                         positions=positions, custom_masks=custom, all_logits=True)


def pad_rows(packed: torch.Tensor, counts: list[int], n: int) -> torch.Tensor:
    """[sum(counts), X] packed per-node rows (logits, features) -> [B, n, X]; padding
    rows repeat the request's row 0."""
    if all(c == n for c in counts):  # full trees (always with verify graphs): a view, no copy
        return packed.view(len(counts), n, packed.shape[-1])
    out = packed.new_empty(len(counts), n, packed.shape[-1])
    start = 0
    for b, c in enumerate(counts):
        out[b, :c] = packed[start:start + c]
        out[b, c:] = packed[start]
        start += c
    return out


def commit_kv(kv: KVManager, req: Req, slots: torch.Tensor, path: list[int], kept: int) -> None:
    """Keep the KV of path[:kept] at positions kv_len.. of req's row; free the rest of `slots`.

    `kept` is the number of tokens the request committed: root + (kept - 1) accepted nodes
    have their KV at the right positions; the last committed token's KV comes next step.
    """
    keep = torch.tensor(path[:kept], dtype=torch.int64)
    kv.table.write(req.row, req.kv_len, slots[keep])
    drop = torch.ones(slots.numel(), dtype=torch.bool)
    drop[keep] = False
    kv.allocator.free(slots[drop])
    req.kv_len += kept
