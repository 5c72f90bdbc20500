"""Unit-test set-up that must precede every test module: without a GPU, Triton kernels run
under the interpreter, and TRITON_INTERPRET=1 only takes effect if it is set before triton
is first imported. Modules that run kernels also set it (fused_utils, triton_interp), but
which module pytest imports first depends on the files chosen, so it is set here once."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
