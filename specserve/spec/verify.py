"""Verify and commit: one target forward over root + drafts, then keep the accepted KV.

Verify runs every request's tree as new tokens at positions seq_len + depth with the
tree mask (the attention backend's custom-mask path); there is no per-algorithm branch.
Commit keeps the slots of the root and the accepted nodes, in path order, at positions
kv_len, kv_len + 1, ... of the request's table row, and frees every other slot of the
step in the same pass: an index write, never a KV copy.
"""
from __future__ import annotations

import torch

from specserve.core.batch import ScheduleBatch
from specserve.core.forward_batch import ForwardMode
from specserve.core.request import Req
from specserve.engine.kv_manager import KVManager
from specserve.spec.drafts import Drafts


def verify_batch(reqs: list[Req], drafts: Drafts, slots: list[torch.Tensor], full: bool = False) -> ScheduleBatch:
    """The VERIFY batch: request b contributes its valid nodes (a prefix of its row), or
    with `full` all N nodes (the shape a captured graph needs). Padding nodes hang off the
    root, no valid node attends to them, and their K/V go to the scratch slot 0.

    Token ids, positions and masks stay on the drafts' device (the GPU for drafted trees):
    building the batch reads nothing back; valid counts come from the host."""
    n, valid = drafts.num_nodes, drafts.valid_counts()
    counts = [n] * len(reqs) if full else valid
    dev = drafts.tokens.device
    positions = torch.tensor([r.kv_len for r in reqs]).to(dev, non_blocking=True)[:, None] + drafts.depths()
    masks = drafts.tree_mask()
    custom: torch.Tensor | list[torch.Tensor]
    if all(c == n for c in counts):
        ids, pos, custom = drafts.tokens.reshape(-1), positions.reshape(-1), masks  # [B, N, N]: no per-request views
    else:
        idx = torch.tensor([b * n + i for b, c in enumerate(counts) for i in range(c)]).to(dev, non_blocking=True)
        ids, pos = drafts.tokens.reshape(-1)[idx], positions.reshape(-1)[idx]
        custom = [masks[b, :c, :c] for b, c in enumerate(counts)]
    if all(c == v == s.numel() for s, c, v in zip(slots, counts, valid)):  # full trees: no per-request slicing
        out_slots = slots
    else:
        out_slots = []
        for s, c, v in zip(slots, counts, valid):
            s = s[:min(c, v)]
            out_slots.append(torch.cat([s, s.new_zeros(c - s.numel())]) if c > s.numel() else s)
    return ScheduleBatch(ForwardMode.VERIFY, reqs, ids, torch.cat(out_slots),
                         [r.kv_len for r in reqs], counts, [True] * len(reqs),
                         positions=pos, custom_masks=custom, all_logits=True)


def decode_batch(reqs: list[Req], drafts: Drafts, slots: list[torch.Tensor]) -> ScheduleBatch:
    """Root-only drafts as a DECODE batch: the root at position kv_len of each request,
    which is exactly plain decoding (and runs on the DECODE graphs). Each root takes the
    first of its request's verify slots; commit frees the others."""
    assert drafts.num_nodes == 1, "a decode batch verifies roots only"
    return ScheduleBatch(ForwardMode.DECODE, reqs, drafts.tokens.reshape(-1), torch.cat([s[:1] for s in slots]),
                         [r.kv_len for r in reqs], [1] * len(reqs), [True] * len(reqs))


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


SMALL_COMMIT = 128  # slots a step's commit reads as a Python list (`commit_kv`)


def commit_kv(kv: KVManager, reqs: list[Req], slots: list[torch.Tensor], paths: list[list[int]],
              kept: list[int], write_table: bool = True, in_node_order: bool = False) -> list[list[int]]:
    """Keep the KV of paths[b][:kept[b]] at positions kv_len.. of each request's row, free
    the rest of `slots`, advance kv_len; return each request's kept slots (host ints).

    `kept[b]` is the number of tokens request b committed: root + (kept - 1) accepted
    nodes have their KV at the right positions; the last committed token's KV comes next
    step. All rows are written in one index write; the step's slots are read as one list.
    `write_table` False: the device wrote them already (EAGLE's draft_ahead), possibly a
    few more for a request that finished inside its path (past its kv_len: never read);
    the host twin is written here (req_table.py). `in_node_order`: the table (both copies)
    holds each request's `slots` in node order from its kv_len (the step wrote them so for
    the verify), so a request that kept nodes 0 .. k-1 (a chain accepted from its root) has
    its rows right already: its write, a host->device copy and a launch, is skipped."""
    # Python touches the kept nodes alone (a few a request); the dropped rest (at batch 64
    # with 32-node trees ~1900 slots a step) are picked by one mask op. A few dozen slots
    # (batch 1) are read once as a list instead: each CPU tensor op costs microseconds of a
    # step the host already bounds at batch 1
    flat = torch.cat(slots) if len(slots) > 1 else slots[0]
    keep_at, start = [], 0
    for s, path, k in zip(slots, paths, kept):
        keep_at += [start + i for i in path[:k]]
        start += s.numel()
    if flat.numel() <= SMALL_COMMIT:
        values = flat.tolist()
        kept_slots = [values[i] for i in keep_at]
        keep_set = set(keep_at)
        dropped = torch.tensor([v for i, v in enumerate(values) if i not in keep_set], dtype=torch.int64)
    else:
        kept_slots = flat[keep_at].tolist()
        mask = torch.ones(flat.numel(), dtype=torch.bool)
        mask[keep_at] = False
        dropped = flat[mask]
    keep_all, start = [], 0
    for k in kept:
        keep_all.append(kept_slots[start:start + k])
        start += k
    rows, starts = [r.row for r in reqs], [r.kv_len for r in reqs]
    if not write_table:
        kv.table.mirror(rows, starts, keep_all)
    else:
        todo = [b for b in range(len(reqs)) if not (in_node_order and paths[b][:kept[b]] == list(range(kept[b])))]
        kv.table.write_many([rows[b] for b in todo], [starts[b] for b in todo], [keep_all[b] for b in todo])
    kv.allocator.free(dropped)
    for req, k in zip(reqs, kept):
        req.kv_len += k
    return keep_all
