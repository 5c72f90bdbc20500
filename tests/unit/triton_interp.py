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


def _patch_fp8_rounding() -> None:
    """The interpreter rounds to fp8 by adding the first dropped bit to the mantissa, with no
    carry into the exponent (31.3 -> 16, not 32) and no ties-to-even; GPUs round to nearest
    even (cvt.rn.satfinite). Round to float8_e4m3fn through torch instead, so a kernel's
    fp8 KV stores compare byte for byte with the torch path (tests/unit/test_kv_fp8.py).
    Inputs are saturated to +-448 by those kernels first, as torch does not saturate."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float
    if getattr(original, "fp8_by_torch", False):
        return
    wide = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16}

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype != tl.float8e4nv or input_dtype not in wide:
            return original(input, input_dtype, output_dtype, rounding_mode)
        x = torch.from_numpy(np.ascontiguousarray(input).view(np.int16) if input_dtype == tl.bfloat16
                             else np.ascontiguousarray(input))
        x = x.view(torch.bfloat16) if input_dtype == tl.bfloat16 else x
        return x.float().to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(input.shape)

    convert.fp8_by_torch = True  # type: ignore[attr-defined]
    interpreter._convert_float = convert


def _patch_bf16_dot() -> None:
    """The interpreter keeps bf16 values as their raw 16 bits (numpy has no bf16) and
    tl.dot hands those integers to np.matmul: widen bf16 operands to float32 first (exact:
    the bits shifted left 16), as a GPU's bf16 MMA multiplies exactly into fp32."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "bf16_widened", False):
        return

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        bits = np.ascontiguousarray(h.data).view(np.uint16).astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot.bf16_widened = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_old_interpreter()
    _patch_fp8_rounding()
    _patch_bf16_dot()
