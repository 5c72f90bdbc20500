"""The drafting pass's row kernels (spec/tree/rows.py) against their torch references.

root_rows: the draft extend's last rows gathered, the hidden one also written to its table
row's buffer (other rows untouched); fan_out: every request's k branches with their rows,
tail starts, per-depth positions and states. CPU under TRITON_INTERPRET, or CUDA.
"""
from __future__ import annotations

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.unit.fused_utils import DEV, both  # first: sets TRITON_INTERPRET on CPU

pytest.importorskip("triton")

from specserve.spec.tree.rows import fan_out, root_rows  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,t,h,with_next", [(1, 6, 64, True), (3, 18, 576, True), (2, 4, 40, False)])
def test_root_rows_is_the_torch_path(b, t, h, with_next, dtype):
    g = torch.Generator().manual_seed(b * 100 + h)
    h_logits = torch.randn(t, h, generator=g).to(DEV, dtype)
    h_next = torch.randn(t, h, generator=g).to(DEV, dtype) if with_next else None
    last = torch.randperm(t, generator=g)[:b].to(DEV)
    dst = torch.randperm(9, generator=g)[:b].to(DEV)
    start = torch.randn(10, h, generator=g).to(DEV, dtype)
    bufs = []

    def run():
        buf = start.clone() if with_next else None
        bufs.append(buf)
        return root_rows(h_logits, h_next, last, dst, buf)

    (x_got, hid_got), (x_ref, hid_ref) = both(run)
    assert torch.equal(x_got, x_ref) and torch.equal(x_got, h_logits[last])
    if with_next:
        assert torch.equal(hid_got, hid_ref) and torch.equal(bufs[0], bufs[1])
        kept = torch.ones(10, dtype=torch.bool, device=DEV)
        kept[dst] = False
        assert torch.equal(bufs[0][dst], h_next[last]) and torch.equal(bufs[0][kept], start[kept])
    else:
        assert hid_got is None and hid_ref is None


@pytest.mark.parametrize("b,k,depths,h", [(1, 6, 4, 576), (3, 4, 1, 64), (2, 1, 7, 0), (5, 8, 3, 40)])
def test_fan_out_is_the_torch_path(b, k, depths, h):
    g = torch.Generator().manual_seed(b * 10 + k)
    rows = torch.randperm(50, generator=g)[:b].to(DEV)
    tail = torch.randint(1, 900, (b,), generator=g).to(DEV)
    states = torch.randn(b, h, generator=g).to(DEV, torch.float16) if h else None
    got, ref = both(lambda: fan_out(rows, tail, states, k, depths))
    for a, r in zip(got, ref):
        assert (a is None and r is None) or (a.dtype == r.dtype and torch.equal(a, r))
    assert got[2].shape == (depths, b * k) and torch.equal(got[2][0], tail.repeat_interleave(k))
