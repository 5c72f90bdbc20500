"""`specserve bench allreduce`: one tensor-parallel all-reduce's time, NCCL against the
symmetric-memory path (engine/tp_group.py), on the GPUs of this host.

Each size is a bf16 tensor [rows, --hidden], summed 64 times in one CUDA graph (as a
decode step's all-reduces run), the graph replayed --iters times; the figure is GPU time
per all-reduce (CUDA events). It checks first that both paths give NCCL's sums.
"""
from __future__ import annotations

import argparse

import torch

from specserve.bench.ranks import run_on_ranks
from specserve.bench.report import report

CALLS = 64


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench allreduce")
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--rows", default="1,16,64,256", help="tokens a step (rows of the tensor), comma-separated")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--output", default="bench_allreduce.jsonl")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    for n, (exact, nccl_us, symm_us) in zip(rows, run_on_ranks(_measure, args.tp_size, args, rows)[0]):
        row = {"bench": "allreduce", "tp_size": args.tp_size, "rows": n, "hidden": args.hidden, "dtype": "bfloat16",
               "nccl_us": nccl_us, "symmetric_us": symm_us, "same_sums": exact,
               "device": torch.cuda.get_device_name(0)}
        report(f"allreduce: TP {args.tp_size} [{n}, {args.hidden}] bf16: NCCL {nccl_us:.1f} us, symmetric memory "
               f"{symm_us:.1f} us ({nccl_us / symm_us:.2f}x), same sums: {exact}", row, args.output)
    return 0


def _measure(args: argparse.Namespace, rows: list[int]) -> list[tuple[bool, float, float]]:
    import torch.distributed as dist

    from specserve.core import parallel
    from specserve.engine.tp_group import SymmetricAllReduce

    fast = parallel.tp().fast or SymmetricAllReduce(dist.group.WORLD)
    out = []
    for n in rows:
        x = torch.randn(n, args.hidden, device="cuda", dtype=torch.bfloat16) * (dist.get_rank() + 1)
        want, got = x.clone(), x.clone()
        dist.all_reduce(want)
        fast(got)
        out.append((torch.equal(got, want), _graph_us(lambda t: dist.all_reduce(t), x, args.iters),
                    _graph_us(fast, x, args.iters)))
    return out


def _graph_us(reduce, x: torch.Tensor, iters: int) -> float:
    t = x.clone()
    for _ in range(3):
        reduce(t)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            reduce(t)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (iters * CALLS)


if __name__ == "__main__":
    raise SystemExit(main())
