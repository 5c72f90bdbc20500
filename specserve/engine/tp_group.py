"""Joining a tensor-parallel group: torch.distributed set up for one engine process.

NCCL carries the model's tensors on GPUs, gloo on the CPU; a second, gloo group carries
the scheduler's messages and host integers on GPUs (core/parallel.py). One collective runs
before anything is captured, so that NCCL's communicator exists before a CUDA graph
records its all-reduces.
"""
from __future__ import annotations

from datetime import timedelta

import torch

from specserve.core import parallel
from specserve.engine.protocol import RankPlace

# A collective that waits longer than this for a peer ends the rank with an error. Rank 0
# shares its inbox every 50 ms even when idle, so only a dead or stuck peer waits this long.
TIMEOUT = timedelta(minutes=10)


def join_tp_group(place: RankPlace) -> None:
    import torch.distributed as dist

    on_gpu = place.gpu is not None
    if on_gpu:
        torch.cuda.set_device(0)  # the one GPU this process sees (engine/process.py)
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://{place.dist_addr}",
                            world_size=place.tp_size, rank=place.rank, timeout=TIMEOUT)
    world = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=TIMEOUT) if on_gpu else world
    parallel.set_tp(parallel.TPGroup(place.tp_size, place.rank, world, cpu_group))
    if on_gpu:
        dist.all_reduce(torch.zeros(1, device="cuda"))
        torch.cuda.synchronize()
