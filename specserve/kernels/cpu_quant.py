"""Quantized linear layers on the CPU: GGUF's blocks (core/quant.py's "q4" and "q8")
multiplied where they lie, from `cpu_quant.c`, compiled on first use together with
`cpu_layers.c` (the decoder stack in one call, kernels/cpu_layers.py).

Why a C file of our own: a decode step on the CPU is bound by the bytes of weights it
reads and the work of decoding them, and the GGUF holds 4-bit blocks, far fewer bytes than
float32 weights. torch's packed int4 CPU op (`_weight_int4pack_mm_for_cpu`) did not serve
float32 activations well (docs/benchmarks.md); its int8 op has one scale per row, not per
block. The C loops dequantize each weight to float32 in registers and multiply in float32,
so the only rounding the quantization adds is the format's own. It is built with the
system's C compiler (`CC`, default `cc`), OpenMP and `-march=native` into the cache
directory (SPECSERVE_CACHE_DIR, default ~/.cache/specserve), keyed by the sources, the
flags, the compiler and this CPU; a machine without a compiler serves the weights
dequantized (`available()` False, said once in the log). Nothing here runs on CUDA tensors.

Invariants: `matmul(x, qw)` equals `x @ qw.dequantize(float32).T` up to float32 rounding
(the tests compare them over every format and a sweep of shapes), and a row's result does
not depend on the other rows nor on the thread count.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from specserve.core import env, quant

logger = logging.getLogger("specserve")

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_quant.h", "cpu_quant.c", "cpu_layers.c"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
METHODS = {quant.Q4: 0, quant.Q8: 1}  # cpu_quant.h's QW_Q4, QW_Q8
_P, _I = ctypes.c_void_p, ctypes.c_int64
_lib: ctypes.CDLL | None = None
_tried = False


def available() -> bool:
    """Whether the compiled kernels load on this machine (compiling them the first time)."""
    return library() is not None


def matmul(x: torch.Tensor, qw: quant.QuantWeight, threads: int | None = None) -> torch.Tensor:
    """x [M, K] float32 @ the q4 / q8 weight [N, K] transposed -> [M, N] float32, on
    `threads` threads (default torch's). Under torch.compile, an opaque custom op (no
    graph break at the C call)."""
    if torch.compiler.is_compiling():
        return torch.ops.specserve.gguf_matmul(x, qw.data, qw.scale, qw.zeros, qw.group, qw.method)
    return _matmul(x, qw, threads)


@torch.library.custom_op("specserve::gguf_matmul", mutates_args=())
def _gguf_matmul_op(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                    group: int, method: str) -> torch.Tensor:
    return _matmul(x, quant.QuantWeight(data, scale, group, method, offset), None)


@_gguf_matmul_op.register_fake
def _(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group: int,
      method: str) -> torch.Tensor:
    return x.new_empty(x.shape[0], data.shape[0], dtype=torch.float32)


def _matmul(x: torch.Tensor, qw: quant.QuantWeight, threads: int | None) -> torch.Tensor:
    lib = library()
    assert lib is not None and qw.method in METHODS, qw.method
    n, k = qw.shape
    x = x.contiguous()
    assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == k, (x.dtype, x.shape, k)
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    offset = qw.zeros.data_ptr() if qw.zeros is not None else None
    lib.qmm(METHODS[qw.method], x.data_ptr(), x.shape[0], k, qw.data.data_ptr(), qw.scale.data_ptr(), offset,
            qw.group, n, y.data_ptr(), threads or torch.get_num_threads())
    return y


def library() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        _tried = True
        try:
            _lib = _load(_build())
        except (OSError, subprocess.SubprocessError) as e:
            logger.warning("quantized CPU kernels unavailable (%s): GGUF weights are served dequantized", e)
    return _lib


def _build() -> Path:
    """The compiled library's path, compiling it unless this machine's build is cached."""
    compiler = env.c_compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    texts = [src.read_text() for src in SOURCES]
    key = hashlib.sha256("\n".join([*texts, " ".join(FLAGS), version, _cpu_id()]).encode()).hexdigest()
    root = Path(env.cache_dir() or Path.home() / ".cache" / "specserve") / "kernels"
    lib = root / f"cpu_quant-{key[:16]}.so"
    if lib.exists():
        return lib
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:  # compiled aside, then renamed: never half-written
        out = Path(tmp) / lib.name
        c_files = [str(src) for src in SOURCES if src.suffix == ".c"]
        subprocess.run([compiler, *FLAGS, *c_files, "-o", str(out)], capture_output=True, text=True, check=True,
                       timeout=300)
        os.replace(out, lib)
    logger.info("compiled the quantized CPU kernels into %s", lib)
    return lib


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.qmm.argtypes = [_I, _P, _I, _I, _P, _P, _P, _I, _I, _P, ctypes.c_int]
    lib.cpu_layers_forward.argtypes = [_P, _I, _P, _P, _P, _I, _P, ctypes.c_int]
    lib.qmm.restype = lib.cpu_layers_forward.restype = ctypes.c_int
    return lib
