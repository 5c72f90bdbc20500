"""This process's place in a tensor-parallel group, and the few collectives the model needs.

A tensor-parallel (TP) engine is `tp_size` processes, one per GPU (or CPU process), that run
the same scheduler on the same inputs (engine/ranks.py says why) and hold 1/tp of every
large weight. The group is set once per process, before any model is built (`set_tp`);
model files read it when they size their shards, and call `all_reduce` after a
row-parallel layer and `gather_vocab` after a vocab-parallel LM head. With `tp_size` 1
(the default, and every process that never calls `set_tp`) each call here is a no-op,
so single-GPU code paths are unchanged.

Two process groups: `group` carries tensors on the model's device (NCCL on GPUs, gloo on
the CPU); `cpu_group` (gloo) carries the scheduler's Python objects from rank 0
(`broadcast_object`) and host integers (`min_int`).

Invariant: every rank calls the same collectives in the same order; a rank that skips one
hangs the others, so anything that decides whether a collective runs must be the same on
every rank (broadcast from rank 0 if it is not).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TPGroup:
    size: int = 1
    rank: int = 0
    group: Any = None  # torch.distributed.ProcessGroup for device tensors (None: the default group)
    cpu_group: Any = None  # a gloo ProcessGroup for host objects
    # A faster all-reduce for small tensors (engine/tp_group.py): fast(x) sums x in place and
    # says True, or says False and leaves x to NCCL
    fast: Callable[[torch.Tensor], bool] | None = None


_tp = TPGroup()


def set_tp(tp: TPGroup) -> None:
    """Join this process to `tp` (once, before models are built); TPGroup() leaves it."""
    global _tp
    _tp = tp


def tp() -> TPGroup:
    return _tp


def tp_size() -> int:
    return _tp.size


def tp_rank() -> int:
    return _tp.rank


def split(n: int, what: str) -> int:
    """n / tp_size, or ValueError naming `what` if n does not divide."""
    if n % _tp.size:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {_tp.size}")
    return n // _tp.size


def head_shard(heads: int, kv_heads: int) -> tuple[int, int, int, int]:
    """(first query head, query heads, first KV head, KV heads) of this rank.

    Heads go in whole GQA groups (a KV head and the query heads that read it), as evenly as
    the groups allow: SmolLM2's 3 groups over 2 ranks are 1 and 2, so each rank's local
    heads keep the standard GQA layout (local query head j reads local KV head j // group)
    and no kernel changes. With fewer KV heads than ranks, each KV head is replicated on
    tp / kv ranks, which split its group's query heads."""
    tp, r = _tp.size, _tp.rank
    group = heads // kv_heads
    if kv_heads >= tp:
        g0, g1 = r * kv_heads // tp, (r + 1) * kv_heads // tp
        return g0 * group, (g1 - g0) * group, g0, g1 - g0
    share = tp // kv_heads  # ranks per KV head
    if tp % kv_heads or group % share:
        raise ValueError(f"the tensor-parallel size {tp} does not fit {heads} attention heads in "
                         f"{kv_heads} KV groups (with fewer KV heads than ranks, each group's "
                         "query heads must split evenly over the ranks that share its KV head)")
    kv, per = r // share, group // share
    return kv * group + (r % share) * per, per, kv, 1


def kv_heads_per_rank(kv_heads: int) -> int:
    """KV heads this rank holds (`head_shard`): what its KV pool is sized for."""
    tp, r = _tp.size, _tp.rank
    if kv_heads >= tp:
        return (r + 1) * kv_heads // tp - r * kv_heads // tp
    return 1


def vocab_per_rank(vocab: int) -> int:
    """Rows of a vocab-parallel embedding or LM head on each rank (the common vocabularies
    divide by 8; one that does not is refused rather than padded)."""
    return split(vocab, "the vocabulary size")


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the group, in place (x unchanged at tp 1)."""
    if _tp.size > 1:
        import torch.distributed as dist

        if _tp.fast is None or not _tp.fast(x):
            dist.all_reduce(x, group=_tp.group)
    return x


def gather_vocab(local: torch.Tensor) -> torch.Tensor:
    """Logits [T, vocab] from each rank's [T, vocab / tp] slice."""
    if _tp.size == 1:
        return local
    import torch.distributed as dist

    t, v = local.shape
    out = torch.empty(_tp.size * t, v, dtype=local.dtype, device=local.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12
    gather(out, local.contiguous(), group=_tp.group)
    return out.view(_tp.size, t, v).permute(1, 0, 2).reshape(t, _tp.size * v)


def broadcast_object(obj: Any = None) -> Any:
    """Rank 0's `obj` on every rank (others pass anything)."""
    if _tp.size == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_tp.cpu_group)
    return box[0]


def broadcast_flag(flag: bool) -> bool:
    """Rank 0's `flag` on every rank: one small collective, for decisions made per step."""
    if _tp.size == 1:
        return flag
    import torch.distributed as dist

    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.broadcast(t, src=0, group=_tp.cpu_group)
    return bool(t.item())


def min_int(n: int) -> int:
    """The smallest `n` over the group (a KV budget every rank can hold)."""
    if _tp.size == 1:
        return n
    import torch.distributed as dist

    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_tp.cpu_group)
    return int(t.item())

