"""The few-token kernel's launch falls back to fewer pipeline stages when a variant needs
more shared memory than its configuration counted, remembers what fit, and computes the
same product."""
from __future__ import annotations

import torch
from triton.runtime.errors import OutOfResources

from specserve.kernels import skinny
from tests.unit.fused_utils import DEV


class _Tight:
    """The real kernel, refusing launches of more than `fits` stages as the compiler does."""

    def __init__(self, kernel, fits: int) -> None:
        self.kernel, self.fits, self.tried = kernel, fits, []

    def __getitem__(self, grid):
        def launch(*args, num_stages: int, **kwargs):
            self.tried.append(num_stages)
            if num_stages > self.fits:
                raise OutOfResources(num_stages * 49152, 232448, "shared memory")
            return self.kernel[grid](*args, num_stages=num_stages, **kwargs)
        return launch


def test_a_launch_that_does_not_fit_retries_with_fewer_stages(monkeypatch):
    x = torch.randn(3, 256, device=DEV)
    w = torch.randn(96, 256, device=DEV)
    tight = _Tight(skinny._skinny_kernel, fits=1)
    monkeypatch.setattr(skinny, "_skinny_kernel", tight)
    monkeypatch.setattr(skinny, "_FITTED", {})
    monkeypatch.setattr(skinny, "_config", lambda *a: skinny.Config(32, 64, 3))
    got = skinny.skinny(x, w)
    torch.testing.assert_close(got, x @ w.T, rtol=1e-4, atol=1e-4)
    assert tight.tried == [3, 2, 1] and list(skinny._FITTED.values()) == [1]
    skinny.skinny(x, w)
    assert tight.tried[3:] == [1]  # remembered: no second failure
