"""Unit-test set-up that must precede every test module: without a GPU, Triton kernels run
under the interpreter, and TRITON_INTERPRET=1 only takes effect if it is set before triton
is first imported. Modules that run kernels also set it (fused_utils, triton_interp), but
which module pytest imports first depends on the files chosen, so it is set here once.

The interpreter multiplies a tl.dot's operands with numpy, whose BLAS may round a row by
its place in the matrix (OpenBLAS's AVX-512 sgemm takes rows in blocks of six: the same
row gave other bits as row 6 of a tile than as row 0). A GPU's tensor cores give a row
the same bits wherever it sits, and the deterministic mode's tests compare a token decoded
alone (row 0 of its tile) with the same token in a prefill (any row), so under the
interpreter each row of a 2-D dot is multiplied alone (`_dot_row_by_row`)."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np
    from triton.runtime import interpreter

    _dot = interpreter.InterpreterBuilder.create_dot

    def _dot_row_by_row(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2:
            return _dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        rows = [_dot(self, interpreter.TensorHandle(a.data[i:i + 1], a.dtype), b,
                     interpreter.TensorHandle(d.data[i:i + 1], d.dtype), input_precision, max_num_imprecise_acc)
                for i in range(a.data.shape[0])]
        return interpreter.TensorHandle(np.concatenate([r.data for r in rows]), rows[0].dtype)

    interpreter.InterpreterBuilder.create_dot = _dot_row_by_row
