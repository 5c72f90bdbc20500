"""Joining a tensor-parallel group: torch.distributed set up for one engine process.

NCCL carries the model's tensors on GPUs, gloo on the CPU; a second, gloo group carries
the scheduler's messages and host integers on GPUs (core/parallel.py). Small all-reduces on
GPUs go through symmetric memory (`SymmetricAllReduce`) unless SPECSERVE_TP_ALLREDUCE=nccl.
One collective runs before anything is captured, so that NCCL's communicator exists before
a CUDA graph records its all-reduces.
"""
from __future__ import annotations

import logging
from datetime import timedelta

import torch

from specserve.core import env, parallel
from specserve.engine.protocol import RankPlace

logger = logging.getLogger("specserve")

# A collective that waits longer than this for a peer ends the rank with an error. Rank 0
# shares its inbox every 50 ms even when idle, so only a dead or stuck peer waits this long.
TIMEOUT = timedelta(minutes=10)


def join_tp_group(place: RankPlace) -> None:
    import torch.distributed as dist

    on_gpu = place.gpu is not None
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://{place.dist_addr}",
                            world_size=place.tp_size, rank=place.rank, timeout=TIMEOUT)
    world = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=TIMEOUT) if on_gpu else world
    fast = _symmetric_all_reduce(world) if on_gpu and env.tp_all_reduce() == "auto" else None
    parallel.set_tp(parallel.TPGroup(place.tp_size, place.rank, world, cpu_group, fast))
    if on_gpu:
        dist.all_reduce(torch.zeros(1, device="cuda"))
        torch.cuda.synchronize()


def _symmetric_all_reduce(group) -> SymmetricAllReduce | None:
    try:
        return SymmetricAllReduce(group)
    except Exception as e:  # noqa: BLE001 - an older torch or driver: NCCL serves alone
        logger.warning("symmetric-memory all-reduce unavailable (%s: %s): NCCL all-reduces every tensor",
                       type(e).__name__, e)
        return None


class SymmetricAllReduce:
    """All-reduce of small tensors through torch's symmetric memory: each rank copies its
    tensor into a buffer every peer can read over NVLink, and one kernel sums the peers'
    copies (one-shot, at 2 ranks) or reduce-scatters and gathers them (two-shot, more
    ranks: every rank then holds the same sums, in the same order, as with NCCL). A
    decode step's all-reduces are a few KB, where NCCL's fixed cost dominates. CUDA graphs
    capture it. Tensors over MAX_BYTES go to NCCL."""

    MAX_BYTES = 8 << 20

    def __init__(self, group) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.name, self.one_shot = group.group_name, group.size() == 2
        if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 9):  # needed before 2.9, deprecated since
            symm_mem.enable_symm_mem_for_group(self.name)
        self.buf = symm_mem.empty(self.MAX_BYTES, dtype=torch.uint8, device=torch.device("cuda"))
        symm_mem.rendezvous(self.buf, self.name)
        self.ops = torch.ops.symm_mem

    def __call__(self, x: torch.Tensor) -> bool:
        n = x.numel() * x.element_size()
        if n > self.MAX_BYTES or n % 16 or not x.is_contiguous():
            return False
        flat = x.view(-1)
        buf = self.buf[:n].view(x.dtype)
        buf.copy_(flat)
        if self.one_shot:
            self.ops.one_shot_all_reduce_out(buf, "sum", self.name, flat)
        else:
            self.ops.two_shot_all_reduce_(buf, "sum", self.name)
            flat.copy_(buf)
        return True
