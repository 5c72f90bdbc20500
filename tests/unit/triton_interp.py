"""Shared set-up of the tests that run Triton kernels through a model: compiled on CUDA, and
on a machine without a GPU under TRITON_INTERPRET=1, which must be set before triton is
first imported (so import this module first). Skips the importing module without triton."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _patch_old_interpreter() -> None:
    """triton <= 3.6's interpreter turns loop bounds into ints with int(array of shape [1]),
    which numpy >= 2.4 rejects (triton-lang/triton#9171), so no runtime-bound loop runs.
    Apply the upstream fix (squeeze first) where it is missing; compiled kernels are unaffected."""
    import inspect

    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if "squeeze" in inspect.getsource(original):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_old_interpreter()
