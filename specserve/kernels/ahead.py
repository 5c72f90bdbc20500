"""One launch for EAGLE's draft-ahead bookkeeping (spec/eagle/proposer.py `draft_ahead`) on CUDA.

Between a verify's greedy walk and its read-back, the draft extend and the next step's
trees are queued from the walk on the device. Done with torch ops, turning the walk into
paths and those into the extend's inputs is some 35 small launches (sort, gathers, masks,
an index write into the table, copies into the extend graph's static buffers): at batch 1,
where the step is GPU-bound, that costs more than the overlap saves. Here one program per
request (and per padding request of the captured batch size) does all of it:

  * path position r of on-path node i = number of on-path nodes before i (node order is
    depth order along a path), lens = the path's length = tokens committed;
  * table[row, start + r] = slots[i] for r < lens (the commit's table write);
  * the extend's static inputs, column r of L: the token committed after path node r
    (that of path node r + 1, the bonus for r = lens - 1), position start + r, slot, and
    feature row b * N + node; past lens: token 0, slot 0, feature row b * N (what
    `_extend_graphed` pads with); its table row, last row b * L + lens - 1, root-state row;
  * padding requests: token 0, position 0, slot 0, feature row 0, the first real request's
    table row, last row p * L, root-state row = RootStates' scratch row;
  * roots[b] = the bonus token, kv_lens[b] = start + lens and tails[b] = start + lens + 1
    - shift (the tree pass's tail start, tree_draft.py), for the tree pass;
  * with a prefix buffer (the extend graph's int32 prefix lengths, which its attention
    reads): start, and 0 for a padding request, so the extend launches no copy of its own.
The reference is the torch path in spec/eagle/proposer.py, which runs everywhere else (and CPU tests
compare the two under TRITON_INTERPRET).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels import pdl_flags
from specserve.kernels.pdl import wait_and_release


@triton.jit
def _ahead_kernel(OnPath, stride_on, Tok, Bonus, stride_bonus, Slots, RowStart, Table, stride_table,
                  Ids, Pos, OutSlots, FeatRows, Rows, Last, Dst, Roots, KvLens, Tails, Prefix32,
                  n_real, scratch_row, shift, N, L, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_PREFIX: tl.constexpr, USE_PDL: tl.constexpr):
    wait_and_release(USE_PDL)  # the walk is the kernel before's
    p = tl.program_id(0)
    col = tl.arange(0, BLOCK_L)
    in_l = col < L
    if p >= n_real:  # a padding request of the captured batch size
        if HAS_PREFIX:
            tl.store(Prefix32 + p, (p * 0).to(tl.int32))
        zero = tl.zeros([BLOCK_L], dtype=tl.int64)
        tl.store(Ids + p * L + col, zero, mask=in_l)
        tl.store(Pos + p * L + col, zero, mask=in_l)
        tl.store(OutSlots + p * L + col, zero, mask=in_l)
        tl.store(FeatRows + p * L + col, zero, mask=in_l)
        tl.store(Rows + p, tl.load(RowStart))  # the first real request's row
        tl.store(Last + p, (p * L).to(tl.int64))
        tl.store(Dst + p, (p * 0 + scratch_row).to(tl.int64))  # p * 0: a tensor even if specialised
        return
    node = tl.arange(0, BLOCK_N)
    in_n = node < N
    on = (tl.load(OnPath + p * stride_on + node, mask=in_n, other=0) != 0).to(tl.int32)
    rank = tl.cumsum(on, axis=0) - on  # [BLOCK_N]: path position of each on-path node
    lens = tl.sum(on, axis=0)
    slot = tl.load(Slots + p * N + node, mask=in_n, other=0)
    tok = tl.load(Tok + p * N + node, mask=in_n, other=0)
    bonus = tl.load(Bonus + p * stride_bonus)
    row = tl.load(RowStart + p)
    start = tl.load(RowStart + n_real + p)
    # [BLOCK_L, BLOCK_N]: node i is path node r (at), or path node r + 1 (after)
    is_on = (on != 0)[None, :]
    at = is_on & (rank[None, :] == col[:, None])
    after = is_on & (rank[None, :] == col[:, None] + 1)
    node_r = tl.sum(tl.where(at, node[None, :], 0), axis=1)
    slot_r = tl.sum(tl.where(at, slot[None, :], 0), axis=1)
    next_tok = tl.sum(tl.where(after, tok[None, :], 0), axis=1)
    committed = col < lens
    ids = tl.where(col == lens - 1, bonus, tl.where(committed, next_tok, 0))
    tl.store(Table + row * stride_table + start + col, slot_r, mask=committed & in_l)
    tl.store(Ids + p * L + col, ids, mask=in_l)
    tl.store(Pos + p * L + col, start + col, mask=in_l)
    tl.store(OutSlots + p * L + col, tl.where(committed, slot_r, 0), mask=in_l)
    tl.store(FeatRows + p * L + col, p * N + tl.where(committed, node_r, 0), mask=in_l)
    tl.store(Rows + p, row)
    tl.store(Dst + p, row)
    tl.store(Last + p, (p * L + lens - 1).to(tl.int64))
    tl.store(Roots + p, bonus)
    tl.store(KvLens + p, start + lens)  # may be the tensor RowStart's second half was copied from
    tl.store(Tails + p, start + lens + 1 - shift)
    if HAS_PREFIX:
        tl.store(Prefix32 + p, start.to(tl.int32))


def draft_ahead_index(on_path: torch.Tensor, tokens: torch.Tensor, bonus: torch.Tensor, slots: torch.Tensor,
                      row_start: torch.Tensor, table: torch.Tensor, static: list[torch.Tensor], padded_bs: int,
                      L: int, scratch_row: int, shift: int = 0, kv_lens: torch.Tensor | None = None,
                      prefix32: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fill the draft-extend graph's static inputs and the table from a greedy walk.

    on_path [B, N] nonzero on the path (bool, or the walk's packed int64 columns: rows may
    be strided), tokens [B, N] and slots [B, N] int64, bonus [B] int64 (any stride); row_start
    [2B] int64 = the requests' table rows, then their kv_len before the verify; static =
    the extend graph's [ids, positions, slots, feature rows] (each >= padded_bs * L) and
    [rows, last, root-state rows] (each >= padded_bs). Returns (roots, kv_lens, tails) [B]
    for the tree pass: the bonus tokens, kv_len after the commit (written into `kv_lens`
    when given) and kv_len after + 1 - shift. prefix32 [>= padded_bs] int32, when given,
    gets the extend's prefix lengths (kv_len before; 0 for padding requests)."""
    b, n = on_path.shape
    assert tokens.shape == slots.shape == (b, n) and bonus.shape == (b,) and row_start.shape == (2 * b,)
    assert all(t.is_contiguous() for t in (tokens, slots, row_start)) and table.stride(1) == on_path.stride(1) == 1
    assert prefix32 is None or (prefix32.dtype == torch.int32 and prefix32.numel() >= padded_bs)
    roots = torch.empty(b, dtype=torch.int64, device=on_path.device)
    kv_lens = torch.empty_like(roots) if kv_lens is None else kv_lens
    tails = torch.empty_like(roots)
    assert kv_lens.shape == (b,) and kv_lens.is_contiguous()
    _ahead_kernel[(padded_bs,)](on_path, on_path.stride(0), tokens, bonus, bonus.stride(0), slots, row_start, table,
                                table.stride(0), *static, roots, kv_lens, tails,
                                prefix32 if prefix32 is not None else tails,
                                b, scratch_row, shift, n, L, BLOCK_L=triton.next_power_of_2(L),
                                BLOCK_N=triton.next_power_of_2(n), HAS_PREFIX=prefix32 is not None, num_warps=1,
                                **pdl_flags(on_path.device))
    return roots, kv_lens, tails
