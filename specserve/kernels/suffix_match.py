"""Each row's suffix matched against its own earlier tokens, and the tokens that followed it.

For row b of `ids` (`rows[b]`, its first `lens[b]` tokens known; the last one, at
`last = lens[b] - 1`, is the suffix's end): a candidate end i < last matches m tokens when
ids[i - j] == ids[last - j] for j = 0 .. m - 1 (m <= max_w). The best candidate has the
longest match of at least `min_w` tokens, the latest among equals. The output row is the
token at `last` followed by n - 1 tokens read on from the best candidate's end, repeating
with the period `last - end` (a text that repeats goes on repeating past what is known);
with no match, the token at `last` n times.

Both forms compute exactly that, with no host read: `_torch` in tensor ops over the whole
row (every position, max_w passes), the kernel one program per row scanning positions
below `last` in blocks. `suffix_match` picks the kernel where the fused kernels run
(`kernels.use_fused`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve import kernels

BLOCK = 1024  # positions a program compares per pass


@triton.jit
def _follow(base, last, C, k, MAX_W: tl.constexpr, MIN_W: tl.constexpr, BLOCK: tl.constexpr):
    """The positions whose tokens follow the best match of the suffix ending at `last`
    (columns k of the output past its first); `last` itself where nothing matches."""
    best = tl.full([BLOCK], -1, tl.int64)
    for start in range(0, last, BLOCK):
        i = start + tl.arange(0, BLOCK)
        run = i < last
        m = tl.zeros([BLOCK], tl.int64)
        for j in tl.static_range(MAX_W):
            run = run & (i >= j)
            cand = tl.load(base + i - j, mask=run, other=0)
            suffix = tl.load(base + tl.maximum(last - j, 0))
            run = run & (cand == suffix)
            m += run.to(tl.int64)
        best = tl.maximum(best, tl.where(m >= MIN_W, m * C + i, -1))
    top = tl.max(best, axis=0)
    end = tl.where(top >= 0, top % C, last)
    return tl.where(top >= 0, end + 1 + k % tl.maximum(last - end, 1), last)


@triton.jit
def _match_kernel(ids_ptr, stride, rows_ptr, lens_ptr, out_ptr, C, N_OUT,
                  MAX_W: tl.constexpr, MIN_W: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    base = ids_ptr + tl.load(rows_ptr + b) * stride
    last = tl.load(lens_ptr + b) - 1
    k = tl.arange(0, BLOCK_N)
    more = k < N_OUT - 1
    follow = _follow(base, last, C, k, MAX_W, MIN_W, BLOCK)
    tl.store(out_ptr + b * N_OUT + 1 + k, tl.load(base + follow, mask=more, other=0), mask=more)
    tl.store(out_ptr + b * N_OUT, tl.load(base + last))


@triton.jit
def _commit_match_kernel(on_ptr, s_on, tok_ptr, s_tok, bonus_ptr, s_bonus, slots_ptr, row_start_ptr, B,
                         table_ptr, s_table, ids_ptr, stride, out_ptr, kv_ptr, C, N,
                         MAX_W: tl.constexpr, MIN_W: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    """`commit_and_match` for chain b: its kept slots into the table, its committed tokens
    into its row of ids, kv_len after, then the next chain from the row."""
    b = tl.program_id(0)
    k = tl.arange(0, BLOCK_N)
    on = tl.load(on_ptr + b * s_on + k, mask=k < N, other=0) != 0
    lens = tl.sum(on.to(tl.int64), axis=0)  # the root and the accepted nodes: a chain's first lens nodes
    row = tl.load(row_start_ptr + b)
    start = tl.load(row_start_ptr + B + b)
    keep = k < lens
    tl.store(table_ptr + row * s_table + start + k, tl.load(slots_ptr + b * N + k, mask=keep), mask=keep)
    nxt = tl.load(tok_ptr + b * s_tok + k + 1, mask=k + 1 < lens, other=0)
    committed = tl.where(k == lens - 1, tl.load(bonus_ptr + b * s_bonus), nxt)
    base = ids_ptr + row * stride
    tl.store(base + start + 1 + k, committed, mask=keep)
    last = start + lens  # the bonus: the next root
    tl.store(kv_ptr + b, last)
    tl.debug_barrier()  # the tokens stored above are read back below, by other threads
    more = k < N - 1
    follow = _follow(base, last, C, k, MAX_W, MIN_W, BLOCK)
    tl.store(out_ptr + b * N + 1 + k, tl.load(base + follow, mask=more, other=0), mask=more)
    tl.store(out_ptr + b * N, tl.load(base + last))


def _torch(ids: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, max_w: int, min_w: int, n: int) -> torch.Tensor:
    h = ids.index_select(0, rows)
    c = h.shape[1]
    pos = torch.arange(c, device=h.device)
    last = lens - 1
    run = pos[None, :] < last[:, None]
    m = torch.zeros(h.shape, dtype=torch.int64, device=h.device)
    for j in range(max_w):
        cand = h.index_select(1, (pos - j).clamp(min=0))
        suffix = h.gather(1, (last - j).clamp(min=0)[:, None])
        run = run & (pos >= j)[None, :] & (cand == suffix)
        m += run
    top = torch.where(m >= min_w, m * c + pos, -1).max(1).values
    found = top >= 0
    end = torch.where(found, top % c, last)
    period = (last - end).clamp(min=1)
    k = torch.arange(n - 1, device=h.device)
    follow = torch.where(found[:, None], end[:, None] + 1 + k[None, :] % period[:, None], last[:, None])
    return torch.cat([h.gather(1, last[:, None]), h.gather(1, follow)], 1)


def suffix_match(ids: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, max_w: int, min_w: int,
                 n: int) -> torch.Tensor:
    """[B, n] int64: per request, the token at lens - 1 of its row of `ids` [R, C] int64 and
    the n - 1 tokens after its best match (module docstring). rows, lens [B] int64 on
    ids' device, 1 <= lens <= C; 1 <= min_w <= max_w."""
    if not kernels.use_fused(ids):
        return _torch(ids, rows, lens, max_w, min_w, n)
    b = rows.shape[0]
    out = torch.empty(b, n, dtype=torch.int64, device=ids.device)
    _match_kernel[(b,)](ids, ids.stride(0), rows, lens, out, ids.shape[1], n, MAX_W=max_w, MIN_W=min_w,
                        BLOCK=BLOCK, BLOCK_N=max(16, triton.next_power_of_2(n)))
    return out


def commit_and_match(on_path: torch.Tensor, tokens: torch.Tensor, bonus: torch.Tensor, slots: torch.Tensor,
                     row_start: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, max_w: int,
                     min_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A greedy walk over chains of N nodes committed on the device, and the next chains:
    on_path [B, N] (nonzero on the root and the accepted nodes, a prefix of each chain),
    tokens [B, N], bonus [B], slots [B, N] the verify's, row_start [2B] the table rows then
    kv_lens before the verify. Writes the kept slots into `table` at kv_len .. and the
    committed tokens (the accepted nodes', then the bonus) into `ids` at kv_len + 1 ..
    Returns the next chains [B, N] (`suffix_match` from the bonus) and kv_len after [B]."""
    b, n = tokens.shape
    rows, start = row_start[:b], row_start[b:]
    if not kernels.use_fused(ids):
        lens = (on_path != 0).sum(1)
        col = torch.arange(n, device=ids.device)
        keep = col < lens[:, None]
        cells = (rows[:, None].expand(b, n), start[:, None] + col)
        table[cells] = torch.where(keep, slots, table[cells])
        committed = torch.where(col < lens[:, None] - 1, tokens.roll(-1, 1), bonus[:, None])
        after = (cells[0], cells[1] + 1)
        ids[after] = torch.where(keep, committed, ids[after])
        kv_after = start + lens
        return _torch(ids, rows, kv_after + 1, max_w, min_w, n), kv_after
    out = torch.empty(b, n, dtype=torch.int64, device=ids.device)
    kv_after = torch.empty(b, dtype=torch.int64, device=ids.device)
    _commit_match_kernel[(b,)](on_path, on_path.stride(0), tokens, tokens.stride(0), bonus, bonus.stride(0),
                               slots, row_start, b, table, table.stride(0), ids, ids.stride(0), out, kv_after,
                               ids.shape[1], n, MAX_W=max_w, MIN_W=min_w, BLOCK=BLOCK,
                               BLOCK_N=max(16, triton.next_power_of_2(n)))
    return out, kv_after
