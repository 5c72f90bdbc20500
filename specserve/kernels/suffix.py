"""Each row's suffix matched against its own earlier tokens, and the tokens that followed it.

For row b of `ids` (`rows[b]`, its first `lens[b]` tokens known; the last one, at
`last = lens[b] - 1`, is the suffix's end): a candidate end i < last matches m tokens when
ids[i - j] == ids[last - j] for j = 0 .. m - 1 (m <= max_w). The best candidate has the
longest match of at least `min_w` tokens, the latest among equals. The output row is the
token at `last` followed by n - 1 tokens read on from the best candidate's end, repeating
with the period `last - end` (a text that repeats goes on repeating past what is known);
with no match, the token at `last` n times.

The kernels compute exactly that, with no host read, one program per row scanning the
positions below `last` in blocks; `commit_and_match` first commits a greedy walk over
chains (its entry point in kernels/__init__.py says what it writes). Their torch forms,
which run everywhere else, live with their caller in spec/ and are tested equal to
these.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

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


def suffix_match(ids: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, max_w: int, min_w: int,
                 n: int) -> torch.Tensor:
    b = rows.shape[0]
    out = torch.empty(b, n, dtype=torch.int64, device=ids.device)
    _match_kernel[(b,)](ids, ids.stride(0), rows, lens, out, ids.shape[1], n, MAX_W=max_w, MIN_W=min_w,
                        BLOCK=BLOCK, BLOCK_N=max(16, triton.next_power_of_2(n)))
    return out


def commit_and_match(on_path: torch.Tensor, tokens: torch.Tensor, bonus: torch.Tensor, slots: torch.Tensor,
                     row_start: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, max_w: int,
                     min_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, n = tokens.shape
    out = torch.empty(b, n, dtype=torch.int64, device=ids.device)
    kv_after = torch.empty(b, dtype=torch.int64, device=ids.device)
    _commit_match_kernel[(b,)](on_path, on_path.stride(0), tokens, tokens.stride(0), bonus, bonus.stride(0),
                               slots, row_start, b, table, table.stride(0), ids, ids.stride(0), out, kv_after,
                               ids.shape[1], n, MAX_W=max_w, MIN_W=min_w, BLOCK=BLOCK,
                               BLOCK_N=max(16, triton.next_power_of_2(n)))
    return out, kv_after
