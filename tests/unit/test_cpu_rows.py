"""kernels/cpu_rows.py's argmax against torch.argmax: the first index among equal maxima,
NaN rows handed to torch, any leading shape, strided input, every vocabulary tail length;
top1's log-probability against torch's log_softmax."""
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


@pytest.mark.parametrize("v", [1, 17, 64, 65, 32000, 49152])
def test_top1_is_torchs_argmax_and_log_softmax(v):
    g = torch.Generator().manual_seed(v)
    x = torch.randn(3, v, generator=g) * 4
    logp, idx = cpu_rows.top1(x)
    assert idx.shape == logp.shape == (3, 1) and logp.dtype == torch.float32
    assert torch.equal(idx[:, 0], x.argmax(-1))
    torch.testing.assert_close(logp, x.log_softmax(-1).gather(-1, idx), rtol=1e-5, atol=1e-5)
    assert torch.equal(cpu_rows.top1(torch.zeros(2, v))[1][:, 0], torch.zeros(2, dtype=torch.int64))  # ties: the first


def test_top1_hands_nan_rows_and_other_dtypes_to_torch():
    x = torch.randn(2, 100)
    x[1, 5] = float("nan")
    assert cpu_rows.top1(x) is None
    assert cpu_rows.top1(torch.randn(2, 100, dtype=torch.float64)) is None
    peaked = torch.full((1, 300), -1e4)
    peaked[0, 7] = 0.0  # one token certain: log-probability 0
    logp, idx = cpu_rows.top1(peaked)
    assert idx.item() == 7 and logp.item() == 0.0
