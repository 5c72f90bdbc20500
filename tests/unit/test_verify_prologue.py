"""The pipelined step's prologue kernel (spec/eagle/verify_prologue.py) against its torch reference.

Random trees over a small table, real and padding requests mixed: the kernel's table
block, positions, padded kv_len / output offsets, int32 prefix lengths and [rows, kv_len]
equal the torch path's (CPU under TRITON_INTERPRET, or CUDA).
"""
from __future__ import annotations

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.unit.fused_utils import DEV  # first: sets TRITON_INTERPRET on CPU

pytest.importorskip("triton")

from specserve import kernels  # noqa: E402
from specserve.cache.req_table import ReqToTokenTable  # noqa: E402
from specserve.spec.drafts import ancestor_mask  # noqa: E402
from specserve.spec.eagle.verify_prologue import verify_prologue  # noqa: E402


def _inputs(b: int, n: int, pads: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
                           for _ in range(b)])
    table = ReqToTokenTable(8, 64, DEV)
    table.table.copy_(torch.randint(0, 1000, table.table.shape, generator=g))
    rows = torch.randperm(table.pad_row, generator=g)[:b]
    rows[b - pads:] = table.pad_row  # the last `pads` requests pad the captured size
    slots = (torch.randperm(500, generator=g)[:b * n] + 1).view(b, n)
    slots[b - pads:] = 0  # padding requests' verify slots: the scratch slot (they share the pad row)
    return {"rows": rows.to(DEV), "kv_len": torch.randint(1, 40, (b,), generator=g).to(DEV),
            "offsets": torch.randint(1, 9, (b,), generator=g).to(DEV), "slots": slots.to(DEV),
            "mask": ancestor_mask(parents).to(DEV), "table": table, "pad_row": table.pad_row,
            "prefix32": torch.full((b + 3,), -7, dtype=torch.int32, device=DEV),
            "row_start": torch.full((2 * b,), -7, dtype=torch.int64, device=DEV)}


@pytest.mark.parametrize("b,n,pads", [(1, 8, 0), (3, 6, 1), (4, 32, 2), (2, 5, 0)])
def test_prologue_kernel_equals_the_torch_path(b, n, pads):
    ref, got = _inputs(b, n, pads, seed=b * 10 + n), _inputs(b, n, pads, seed=b * 10 + n)
    with kernels.fused_kernels(False):
        want_pos = verify_prologue(**ref)
    with kernels.fused_kernels(True):
        pos = verify_prologue(**got)
    assert torch.equal(pos, want_pos)
    for key in ("kv_len", "offsets", "prefix32", "row_start"):
        assert torch.equal(got[key], ref[key]), key
    assert torch.equal(got["table"].table, ref["table"].table)
    real = slice(0, b - pads)
    assert (got["kv_len"][b - pads:] == 0).all() and (got["offsets"][b - pads:] == 0).all()
    assert (pos.view(b, n)[real, 0] == got["kv_len"][real]).all()  # the root sits at kv_len
    assert (got["prefix32"][b:] == -7).all()  # nothing past the batch
    assert torch.equal(got["row_start"], torch.cat([got["rows"], got["kv_len"]]))  # after the padding rewrite
