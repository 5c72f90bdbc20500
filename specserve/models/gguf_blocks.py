"""GGUF's quantized blocks, repacked for the CPU's kernels (core/quant.py's q4 and q8).

A conversion (models/gguf.py) writes, besides the float32 `model.safetensors` that any
loader reads, `gguf/blocks.safetensors`: for each quantized linear weight (HF name `W`),
`W.q` (the integers), `W.scale` and, where the format has them, `W.offset` (float32
[N, groups]), its method and group in the metadata. The loader serves those instead of the
float weights on the CPU (models/gguf_serve.py).

| GGUF type | method, group | q | scale | offset |
|---|---|---|---|---|
| Q4_0 | q4, 32 | q | d | -8 d |
| Q4_1 | q4, 32 | q | d | m |
| Q4_K | q4, 32 | q | d sc | -dmin m |
| Q5_0 | q8, 32 | q - 16 | d | none |
| Q5_1 | q8, 32 | q | d | m |
| Q5_K | q8, 32 | q | d sc | -dmin m |
| Q8_0 | q8, 32 | q | d | none |
| Q6_K | q8, 16 | q - 32 | d sc | none |

Invariant: q * scale + offset, in float32, is the value gguf's own dequantizer gives
(the same products and sums in the same order: the tests compare them bit for bit). Other
types (Q2_K, Q3_K, the IQ formats, F16/F32) are not repacked; their layers stay float.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K

BLOCKS_FILE = "gguf/blocks.safetensors"  # a subdirectory: no loader globbing *.safetensors reads it
QK_K = 256


class Repacked(NamedTuple):
    method: str  # "q4" or "q8"
    group: int
    q: np.ndarray  # q4: uint8 [N, K / 2]; q8: int8 [N, K]
    scale: np.ndarray  # float32 [N, K / group]
    offset: np.ndarray | None  # float32 [N, K / group]


def repackable(tensor_type: T) -> bool:
    return tensor_type in _REPACK


def repack(raw: np.ndarray, tensor_type: T, rows: int, cols: int) -> Repacked:
    """The q4/q8 form of a GGUF tensor's raw blocks (`ReaderTensor.data`) holding a weight
    [rows, cols] (HF order: rows are outputs)."""
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows * cols // _BLOCK[tensor_type], -1)
    method, group, q, scale, offset = _REPACK[tensor_type](blocks)
    q4 = method == "q4"
    q = _pack_q4(q.reshape(rows, cols)) if q4 else q.reshape(rows, cols).astype(np.int8)
    groups = cols // group
    return Repacked(method, group, q, scale.reshape(rows, groups).astype(np.float32),
                    None if offset is None else offset.reshape(rows, groups).astype(np.float32))


def permute_rows(r: Repacked, perm: np.ndarray) -> Repacked:
    """The same weight with its rows (outputs) reordered: blocks run along the columns."""
    return Repacked(r.method, r.group, r.q[perm], r.scale[perm], None if r.offset is None else r.offset[perm])


# our fused projections (models/checkpoint.py) and their Hugging Face parts, in row order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fuse(weights: dict[str, Repacked]) -> dict[str, Repacked]:
    """`weights` with each layer's q/k/v and gate/up stacked by rows under our fused names
    where the parts share one form (method, group, offsets or none): the server then maps
    every projection straight from the file (models/gguf_serve.py), one copy in memory for
    every process that serves it."""
    out = dict(weights)
    for name in weights:
        for fused, parts in FUSED.items():
            if not name.endswith(f".{parts[0]}.weight"):
                continue
            names = [name.replace(f".{parts[0]}.", f".{p}.") for p in parts]
            found = [weights[n] for n in names if n in weights]
            if len(found) < len(parts) or len({(r.method, r.group, r.offset is None) for r in found}) > 1:
                continue
            for n in names:
                del out[n]
            offset = None if found[0].offset is None else np.concatenate([r.offset for r in found])
            out[name.replace(f".{parts[0]}.", f".{fused}.")] = Repacked(
                found[0].method, found[0].group, np.concatenate([r.q for r in found]),
                np.concatenate([r.scale for r in found]), offset)
    return out


def save(path: Path, weights: dict[str, Repacked]) -> None:
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {}
    for name, r in weights.items():
        tensors[f"{name}.q"], tensors[f"{name}.scale"] = np.ascontiguousarray(r.q), np.ascontiguousarray(r.scale)
        if r.offset is not None:
            tensors[f"{name}.offset"] = np.ascontiguousarray(r.offset)
        meta[name] = [r.method, r.group]
    save_file(tensors, str(path), metadata={"format": "pt", "specserve.gguf_blocks": json.dumps(meta)})


def methods(path: Path) -> dict[str, tuple[str, int]]:
    """{weight name (Hugging Face's, or a fused projection of ours: `fuse`): (method, group)}
    of a blocks file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("specserve.gguf_blocks", "{}"))
    return {name: (m, int(g)) for name, (m, g) in meta.items()}


def _pack_q4(q: np.ndarray) -> np.ndarray:
    """uint8 [N, K / 2] of 4-bit values [N, K]: per 32 columns, column j low, j + 16 high."""
    g = q.astype(np.uint8).reshape(q.shape[0], -1, 2, 16)
    return (g[:, :, 0] | (g[:, :, 1] << np.uint8(4))).reshape(q.shape[0], -1)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Values of bytes [n, ...] whose rows of `width` bytes hold `width` values low, then
    `width` high."""
    n = qs.shape[0]
    x = qs.reshape(n, -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (x & np.uint8(0x0F)).reshape(n, -1)


def _high_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """The fifth bit of 32 values per block from a little-endian uint32 [n, 4 bytes]."""
    bits = np.ascontiguousarray(qh).view(np.uint32).reshape(n, 1) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    return (bits & np.uint32(1)).astype(np.uint8)


def _q4_0(b: np.ndarray) -> tuple:
    d = _f16(b[:, :2])
    return "q4", 32, _nibbles(b[:, 2:], 16), d, -8 * d


def _q4_1(b: np.ndarray) -> tuple:
    return "q4", 32, _nibbles(b[:, 4:], 16), _f16(b[:, :2]), _f16(b[:, 2:4])


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale [n, 8], offset [n, 8]) of a Q4_K/Q5_K super-block's sub-blocks."""
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return _f16(b[:, :2]) * sc.astype(np.float32), -(_f16(b[:, 2:4]) * m.astype(np.float32))


def _q4_k(b: np.ndarray) -> tuple:
    scale, offset = _k_scales(b)
    return "q4", 32, _nibbles(b[:, 16:], 32), scale, offset


def _q5_0(b: np.ndarray) -> tuple:
    q = _nibbles(b[:, 6:], 16) | (_high_bits(b[:, 2:6], b.shape[0]) << np.uint8(4))
    return "q8", 32, q.astype(np.int8) - np.int8(16), _f16(b[:, :2]), None


def _q5_1(b: np.ndarray) -> tuple:
    q = _nibbles(b[:, 8:], 16) | (_high_bits(b[:, 4:8], b.shape[0]) << np.uint8(4))
    return "q8", 32, q.astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_k(b: np.ndarray) -> tuple:
    n = b.shape[0]
    scale, offset = _k_scales(b)
    qh = b[:, 16:16 + QK_K // 8].reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    q = _nibbles(b[:, 16 + QK_K // 8:], 32) | ((qh & np.uint8(1)).reshape(n, -1) << np.uint8(4))
    return "q8", 32, q.astype(np.int8), scale, offset


def _q8_0(b: np.ndarray) -> tuple:
    return "q8", 32, np.ascontiguousarray(b[:, 2:]).view(np.int8), _f16(b[:, :2]), None


def _q6_k(b: np.ndarray) -> tuple:
    n = b.shape[0]
    ql, qh = b[:, :QK_K // 2], b[:, QK_K // 2:QK_K // 2 + QK_K // 4]
    sc = np.ascontiguousarray(b[:, QK_K // 2 + QK_K // 4:QK_K // 2 + QK_K // 4 + QK_K // 16]).view(np.int8)
    d = _f16(b[:, -2:])
    low = _nibbles(ql, 64).reshape(n, -1, 32)
    high = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    q = (low | (high.reshape(n, -1, 32) << np.uint8(4))).astype(np.int8) - np.int8(32)
    return "q8", 16, q.reshape(n, -1), d * sc.astype(np.float32), None


_REPACK = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q4_K: _q4_k, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q5_K: _q5_k,
           T.Q8_0: _q8_0, T.Q6_K: _q6_k}
_BLOCK = {T.Q4_0: 32, T.Q4_1: 32, T.Q5_0: 32, T.Q5_1: 32, T.Q8_0: 32, T.Q4_K: QK_K, T.Q5_K: QK_K, T.Q6_K: QK_K}
