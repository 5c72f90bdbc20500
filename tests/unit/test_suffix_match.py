"""spec/ngram/match.py and kernels/suffix.py: both forms against a plain Python statement of the rule, on
random rows over a small vocabulary (many matches, ties among equal lengths), rows that
repeat with a short period (the draft wraps past the known tokens), and no match."""
from __future__ import annotations

import random

import pytest
import torch

from specserve import kernels
from specserve.spec.ngram.match import commit_and_match, suffix_match


def _expected(row: list[int], length: int, max_w: int, min_w: int, n: int) -> list[int]:
    last = length - 1
    best = None  # (match length, end)
    for i in range(last):
        m = 0
        while m < max_w and i - m >= 0 and row[i - m] == row[last - m]:
            m += 1
        if m >= min_w and (best is None or (m, i) >= best):
            best = (m, i)
    if best is None:
        return [row[last]] * n
    end = best[1]
    return [row[last]] + [row[end + 1 + k % (last - end)] for k in range(n - 1)]


def _device(fused: bool) -> str:
    """The fused form runs under the interpreter on the CPU, compiled on a GPU machine."""
    return "cuda" if fused and torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("fused", [False, True])
def test_both_forms_follow_the_rule(fused):
    rng = random.Random(0)
    dev = _device(fused)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4, (6, 300), generator=g)
    ids[2, :120] = torch.tensor([5, 6, 7] * 40)  # a period of 3: drafts wrap past the known tokens
    ids[4] = torch.arange(300)  # no token repeats: no match
    for _ in range(8 if fused else 40):
        b = rng.randint(1, 6)
        rows = [rng.randrange(6) for _ in range(b)]
        lens = [rng.randint(1, 120 if r == 2 else 300) for r in rows]
        max_w, n = rng.randint(1, 6), rng.randint(1, 12)
        min_w = rng.randint(1, max_w)
        with kernels.fused_kernels(fused):
            got = suffix_match(ids.to(dev), torch.tensor(rows, device=dev), torch.tensor(lens, device=dev),
                               max_w, min_w, n)
        want = [_expected(ids[r].tolist(), ln, max_w, min_w, n) for r, ln in zip(rows, lens)]
        assert got.tolist() == want, (rows, lens, max_w, min_w, n)


def test_the_commit_and_match_forms_agree():
    """commit_and_match: the fused form (interpreter) writes the same table cells and ids
    and returns the same chains and kv_lens as the torch form, from a walk's packed rows
    (on_path and bonus are strided views, as accept.py hands them over)."""
    rng = random.Random(1)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        b, n = rng.randint(1, 4), rng.randint(2, 8)
        rows = torch.tensor(rng.sample(range(6), b))
        start = torch.tensor([rng.randint(0, 60) for _ in range(b)])
        accepted = [rng.randint(0, n - 1) for _ in range(b)]
        on_path = torch.tensor([[int(i <= a) for i in range(n)] for a in accepted])
        tokens = torch.randint(0, 3, (b, n), generator=g)
        packed = torch.cat([on_path, tokens, torch.randint(0, 3, (b, 1), generator=g)], 1)
        slots = torch.randint(1, 1000, (b, n), generator=g)
        ids = torch.randint(0, 3, (6, 80), generator=g)
        table = torch.randint(0, 1000, (7, 80), generator=g)
        results = []
        for fused in (False, True):
            dev = _device(fused)
            p, t, i = packed.to(dev), table.to(dev), ids.to(dev)
            with kernels.fused_kernels(fused):
                chains, kv_after = commit_and_match(p[:, :n], tokens.to(dev), p[:, 2 * n:][:, 0], slots.to(dev),
                                                    torch.cat([rows, start]).to(dev), t, i, 3, 1)
            results.append((chains.tolist(), kv_after.tolist(), t.cpu(), i.cpu()))
        (c0, k0, t0, i0), (c1, k1, t1, i1) = results
        assert c0 == c1 and k0 == k1 and torch.equal(t0, t1) and torch.equal(i0, i1)
        assert k0 == [s + a + 1 for s, a in zip(start.tolist(), accepted)]
        for r, s, a, bb in zip(rows.tolist(), start.tolist(), accepted, range(b)):
            assert t0[r, s:s + a + 1].tolist() == slots[bb, :a + 1].tolist()
            assert i0[r, s + 1:s + a + 2].tolist() == tokens[bb, 1:a + 1].tolist() + [packed[bb, 2 * n].item()]
            assert c0[bb][0] == packed[bb, 2 * n].item()  # the next chain's root is the bonus
