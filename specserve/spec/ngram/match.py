"""The suffix match NGRAM drafts from on the device (lookup.py), and its torch forms.

The rule is kernels/suffix.py's: the token at the end of a request's known ids, then the
tokens that followed the longest (then latest) earlier match of its last max_w .. min_w
tokens, repeating with the match's period; the last token n times where nothing matches.
`suffix_match` and `commit_and_match` take those kernels where the fused kernels run
(`kernels.use_fused`), these torch ops elsewhere: over the whole row (every position,
max_w passes), no host read either way. tests/unit/test_suffix_match.py holds both to a
plain Python statement of the rule.
"""
from __future__ import annotations

import torch

from specserve import kernels


def suffix_match(ids: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, max_w: int, min_w: int,
                 n: int) -> torch.Tensor:
    """[B, n] int64: per request, the token at lens - 1 of its row of `ids` [R, C] int64 and
    the n - 1 tokens after its best match (the rule above). rows, lens [B] int64 on ids'
    device, 1 <= lens <= C; 1 <= min_w <= max_w."""
    if kernels.use_fused(ids):
        return kernels.suffix_match(ids, rows, lens, max_w, min_w, n)
    return _match(ids, rows, lens, max_w, min_w, n)


def commit_and_match(on_path: torch.Tensor, tokens: torch.Tensor, bonus: torch.Tensor, slots: torch.Tensor,
                     row_start: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, max_w: int,
                     min_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A greedy walk over chains committed on the device, and the next chains
    (`kernels.commit_and_match` says what it writes). (chains [B, N], kv_len after [B])."""
    if kernels.use_fused(ids):
        return kernels.commit_and_match(on_path, tokens, bonus, slots, row_start, table, ids, max_w, min_w)
    b, n = tokens.shape
    rows, start = row_start[:b], row_start[b:]
    lens = (on_path != 0).sum(1)
    col = torch.arange(n, device=ids.device)
    keep = col < lens[:, None]
    cells = (rows[:, None].expand(b, n), start[:, None] + col)
    table[cells] = torch.where(keep, slots, table[cells])
    committed = torch.where(col < lens[:, None] - 1, tokens.roll(-1, 1), bonus[:, None])
    after = (cells[0], cells[1] + 1)
    ids[after] = torch.where(keep, committed, ids[after])
    kv_after = start + lens
    return _match(ids, rows, kv_after + 1, max_w, min_w, n), kv_after


def _match(ids: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, max_w: int, min_w: int, n: int) -> torch.Tensor:
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


