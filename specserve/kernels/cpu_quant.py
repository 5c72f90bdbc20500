"""Quantized linear layers on the CPU: GGUF's blocks (core/quant.py's "q4" and "q8")
multiplied by `cpu_quant.c`, compiled on first use together with `cpu_layers.c` (the
decoder stack in one call, kernels/cpu_layers.py).

Why a C file of our own: a decode step on the CPU is bound by the bytes of weights it
reads and the work of decoding them, and the GGUF holds 4-bit blocks, far fewer bytes than
float32 weights. torch's packed int4 CPU op (`_weight_int4pack_mm_for_cpu`) did not serve
float32 activations well (docs/benchmarks.md); its int8 op has one scale per row, not per
block. The kernel reads each weight once in a tile layout made for it (`pack`: 16 output
rows side by side, so one vector instruction multiplies 16 rows by two columns of x), and
multiplies integers: x's rows are rounded to int16 per 32-column block (cpu_quant.c's
docstring), a rounding some 2^-16 of the block's largest value, where int8 activations
(llama.cpp's choice) changed the greedy text of most prompts of the default model. It is
built with the system's C compiler (`CC`, default `cc`), OpenMP and `-march=native` into
the cache directory (SPECSERVE_CACHE_DIR, default ~/.cache/specserve), keyed by the
sources, the flags, the compiler and this CPU; a machine without a compiler serves the
weights dequantized (`available()` False, said once in the log). Nothing here runs on
CUDA tensors.

Invariants: `matmul(x, qw)` equals `reference(x, qw)` (x rounded as the kernel rounds it,
times the dequantized weight) up to float32 rounding; a row's result does not depend on
the other rows nor on the thread count. A weight's tile layout is made once and kept
while its `QuantWeight.data` lives; one made here sits in huge pages where the system
gives them (kernels/huge_pages.py).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import platform
import subprocess
import tempfile
import weakref
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from specserve.core import env, quant
from specserve.kernels import huge_pages

logger = logging.getLogger("specserve")

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("cpu_quant.h", "cpu_exp.h", "cpu_quant.c", "cpu_layers.c", "cpu_rows.c"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
METHODS = {quant.Q4: 0, quant.Q8: 1}  # cpu_quant.h's QW_Q4, QW_Q8
LAYOUT = 1  # the version of `pack`'s layout, in the files of `map_packed`
TILE, SUPER, XBLOCK = 16, 4, 32  # cpu_quant.h: output rows a tile, tiles a super-tile, columns an x scale
_P, _I = ctypes.c_void_p, ctypes.c_int64
_lib: ctypes.CDLL | None = None
_tried = False


class Packed(NamedTuple):
    """A q4/q8 weight [N, K] in cpu_quant.h's layout: super-tiles of 64 output rows, their
    integers, scales and offsets together, group after group."""

    method: str
    n: int
    k: int
    group: int
    half: bool  # scales and offsets in float16 (each exact in it), else float32
    has_offset: bool
    data: torch.Tensor  # uint8


_packed: dict[int, Packed] = {}  # id(QuantWeight.data) -> its tile layout, dropped with the data


def servable(qw: quant.QuantWeight) -> bool:
    """Whether the kernels read this weight: GGUF blocks of whole tiles and 32-column steps."""
    n, k = qw.shape
    groups = (32,) if qw.method == quant.Q4 else (16, 32)
    return qw.method in METHODS and n % TILE == 0 and k % XBLOCK == 0 and qw.group in groups


def pack(qw: quant.QuantWeight) -> Packed:
    """`qw` in the tile layout, made on the first call and kept while `qw.data` lives."""
    key = id(qw.data)
    found = _packed.get(key)
    if found is None:
        assert servable(qw), (qw.method, qw.shape, qw.group)
        found = _packed[key] = _pack(qw)
        weakref.finalize(qw.data, _packed.pop, key, None)
    return found


def _pack(qw: quant.QuantWeight) -> Packed:
    n, k = qw.shape
    tiles, groups = n // TILE, k // qw.group

    def lanes(t: torch.Tensor) -> torch.Tensor:  # [N, groups] -> [tiles, groups, 16]
        return t.float().reshape(tiles, TILE, groups).transpose(1, 2)

    parts = [lanes(qw.scale)] + ([] if qw.zeros is None else [lanes(qw.zeros)])
    half = all(torch.equal(t.half().float(), t) for t in parts)  # fewer bytes a step
    parts = [_bytes(t.half() if half else t) for t in parts]
    if qw.method == quant.Q4:  # words (t, g, j, i): nibble p < 4 column 8j + 2p, p >= 4 column 8j + 2(p - 4) + 1
        blocks = qw.data.reshape(n, groups, 16)
        q = torch.cat((blocks & 0xF, blocks >> 4), dim=2).to(torch.int64)  # [N, groups, 32] in column order
        q = q.reshape(tiles, TILE, groups, 4, 4, 2)  # column 8j + 2p + h
        shifts = (4 * torch.arange(4).reshape(4, 1) + 16 * torch.arange(2).reshape(1, 2))
        words = (q << shifts).sum(dim=(4, 5)).permute(0, 2, 3, 1).contiguous()  # [tiles, groups, 4, 16]
        ints = torch.from_numpy(words.numpy().astype(np.uint32).view(np.uint8)).reshape(tiles, groups, -1)
    else:  # (t, g, column pair s, lane i, 2)
        ints = qw.data.reshape(tiles, TILE, groups, qw.group // 2, 2).permute(0, 2, 3, 1, 4)
        ints = _bytes(ints.reshape(tiles, groups, -1))
    supers = [_super(t0, min(t0 + SUPER, tiles), [ints, *parts]) for t0 in range(0, tiles, SUPER)]
    return Packed(qw.method, n, k, qw.group, half, qw.zeros is not None, huge_pages.copy(torch.cat(supers)))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """[tiles, groups, ...] -> uint8 [tiles, groups, bytes]"""
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], t.shape[1], -1)


def _super(t0: int, t1: int, parts: list[torch.Tensor]) -> torch.Tensor:
    """Tiles t0 .. t1 as one super-tile: group after group, every part of every tile"""
    return torch.cat([p[t0:t1].transpose(0, 1).reshape(p.shape[1], -1) for p in parts], dim=1).reshape(-1)


def map_packed(path: Path, weights: dict[str, quant.QuantWeight], source: str, private: bool = False) -> bool:
    """Give each servable weight its layout from the file at `path`, mapped (one copy in
    memory for every process serving the model, as its blocks are), writing the file first
    unless it holds these weights' layouts made from `source` (the blocks file's identity)
    by this LAYOUT. `private` (a process that serves the model alone): copied from the file
    into huge pages instead (kernels/huge_pages.py). False where the file cannot be
    written: the layouts are then made in memory on first use."""
    from safetensors import safe_open

    weights = {name: qw for name, qw in weights.items() if servable(qw)}
    key = json.dumps({"layout": LAYOUT, "source": source,
                      "weights": {n: [w.method, *w.shape, w.group] for n, w in weights.items()}}, sort_keys=True)
    try:
        if not path.is_file() or _read_meta(path).get("key") != key:
            _write_layouts(path, weights, key)
        flags = json.loads(_read_meta(path)["flags"])
        with safe_open(str(path), framework="pt") as f:
            for name, qw in weights.items():
                n, k = qw.shape
                half, has_offset = (bool(v) for v in flags[name])
                data = f.get_tensor(name)
                data = huge_pages.copy(data) if private else data
                _packed[id(qw.data)] = Packed(qw.method, n, k, qw.group, half, has_offset, data)
                weakref.finalize(qw.data, _packed.pop, id(qw.data), None)
    except OSError as e:
        logger.info("the CPU kernels' weight layout is kept in memory, not in %s (%s)", path, e)
        return False
    return True


def _write_layouts(path: Path, weights: dict[str, quant.QuantWeight], key: str) -> None:
    from safetensors.torch import save_file

    packed = {name: _pack(qw) for name, qw in weights.items()}
    flags = json.dumps({name: [int(w.half), int(w.has_offset)] for name, w in packed.items()})
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # written aside, then renamed: never half-written
        out = Path(tmp) / path.name
        save_file({name: w.data for name, w in packed.items()}, str(out), metadata={"key": key, "flags": flags})
        os.replace(out, path)


def _read_meta(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


def reference(x: torch.Tensor, qw: quant.QuantWeight) -> torch.Tensor:
    """float64 [M, N]: x rounded as the kernel rounds it (int16, one scale a 32-column
    block), times the dequantized weight: what `matmul` computes, up to its float32 sums."""
    m, k = x.shape
    blocks = x.double().reshape(m, k // XBLOCK, XBLOCK)
    amax = blocks.abs().amax(dim=2, keepdim=True).float()
    some = amax > 1e-30
    inv = torch.where(some, 32767.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks.float() * inv)
    rounded = (q.double() * torch.where(some, amax / 32767.0, torch.zeros_like(amax)).double()).reshape(m, k)
    out = rounded @ qw.dequantize(torch.float64).t()
    if qw.zeros is not None:  # the kernel takes x's own sums for the offsets
        out += (x.double() - rounded) @ qw.zeros.double().repeat_interleave(qw.group, dim=1).t()
    return out


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
    assert lib is not None, "the quantized CPU kernels are not built"
    w = pack(qw)
    x = x.contiguous()
    assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == w.k, (x.dtype, x.shape, w.k)
    rows = x.shape[0]
    y = torch.empty(rows, w.n, dtype=torch.float32)
    xq = torch.empty(rows, w.k, dtype=torch.int16)
    xd, xs = torch.empty(rows, w.k // XBLOCK), torch.empty(rows, w.k // 16)
    lib.qmm(METHODS[w.method], x.data_ptr(), rows, w.k, w.data.data_ptr(), w.group, int(w.half), int(w.has_offset),
            w.n, y.data_ptr(), threads or torch.get_num_threads(), xq.data_ptr(), xd.data_ptr(), xs.data_ptr())
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
    lib.qmm.argtypes = [_I, _P, _I, _I, _P, _I, _I, _I, _I, _P, ctypes.c_int, _P, _P, _P]
    lib.cpu_layers_forward.argtypes = [_P, _I, _P, _P, _P, _I, _P, ctypes.c_int, _P, _P]
    lib.qmm.restype = lib.cpu_layers_forward.restype = ctypes.c_int
    lib.rows_argmax.argtypes = [_P, _I, _I, _P]  # kernels/cpu_rows.py
    lib.rows_top1.argtypes = [_P, _I, _I, _P, _P]
    lib.rows_argmax.restype = lib.rows_top1.restype = None
    return lib
