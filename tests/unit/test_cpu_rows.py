"""kernels/cpu_rows.py's argmax against torch.argmax: the first index among equal maxima,
NaN rows handed to torch, any leading shape, strided input, every vocabulary tail length."""
from __future__ import annotations

import pytest
import torch

from specserve.kernels import cpu_quant, cpu_rows

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler: torch's argmax serves")


@pytest.mark.parametrize("v", [1, 5, 16, 17, 63, 64, 65, 200, 32000, 49152])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 3)])
def test_argmax_is_torchs(v, lead):
    g = torch.Generator().manual_seed(v)
    x = torch.randn(*lead, v, generator=g)
    assert torch.equal(cpu_rows.argmax(x), x.argmax(-1))
    ties = torch.randint(0, 3, (*lead, v), generator=g).float()  # many equal maxima: the first wins
    assert torch.equal(cpu_rows.argmax(ties), ties.argmax(-1))
    ties.view(-1, v)[0, v // 2] = float("nan")
    assert torch.equal(cpu_rows.argmax(ties), ties.argmax(-1))


def test_argmax_of_strided_and_infinite_rows():
    x = torch.randn(4, 200)[:, :150]
    assert torch.equal(cpu_rows.argmax(x), x.argmax(-1))
    inf = torch.full((2, 100), float("-inf"))
    inf[1, 70] = float("inf")
    assert torch.equal(cpu_rows.argmax(inf), inf.argmax(-1))
    doubles = torch.randn(3, 100, dtype=torch.float64)  # not the kernel's dtype: torch's argmax
    assert torch.equal(cpu_rows.argmax(doubles), doubles.argmax(-1))
