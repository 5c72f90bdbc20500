"""`specserve bench blocks`: the GGUF-block kernels (kernels/blocks.py, blocks_x16.py,
blocks_tc.py) against the bf16 kernels at a model shape's linear layers, on one GPU.

For each layer of the --shape (Llama-3.1 8B or 70B: fused qkv, o, fused gate_up, down, and
the LM head) it makes a random bf16 weight, its blocks as a Q4_1 GGUF holds them (the head
as Q8_0: core/quant.py `quantize_blocks`), or with --q4-group 64 to 256 the layers as an
AWQ/GPTQ checkpoint's int4 groups are held on a GPU (q4 blocks sharing a scale a group:
core/quant.py `int4_to_q4`), and times, at each --tokens count, the bf16
product (`kernels.gemv`: the GEMV or the few-token kernel) and the blocks' product, each
as --calls launches in one CUDA graph (GPU time per launch, CUDA events). Reported: us a
launch, the stored bytes over that time, and the blocks' speed as a ratio to bf16's.
Small layers stay in L2 across the graph's launches, for both. `--launch` times one
(BLOCK_N, GROUPS, num_warps) of blocks.py's kernels instead of the default path (up to
four tokens of bf16 x go to blocks_x16.py's), for tuning.
"""
from __future__ import annotations

import argparse

import torch

from specserve.bench.limit import SHAPES
from specserve.bench.report import report


def layer_shapes(shape: str) -> list[tuple[str, int, int, str]]:
    """(name, rows N, columns K, block form) of one decoder layer's products and the head."""
    c = SHAPES[shape]
    h, i, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = h // heads
    return [("qkv", (heads + 2 * kv) * d, h, "q4"), ("o", h, heads * d, "q4"), ("gate_up", 2 * i, h, "q4"),
            ("down", h, i, "q4"), ("head", c["vocab_size"], h, "q8")]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench blocks")
    p.add_argument("--shape", default="8b", choices=tuple(SHAPES))
    p.add_argument("--tokens", default="1,16", help="rows of x, comma-separated")
    p.add_argument("--calls", type=int, default=50, help="launches a CUDA graph replays")
    p.add_argument("--launch", default=None, help="BLOCK_N,GROUPS,num_warps for every layer (tuning)")
    p.add_argument("--q4-group", type=int, default=32, choices=(32, 64, 128, 256),
                   help="columns a q4 layer's scale covers: 32 a GGUF's Q4_1, more an AWQ/GPTQ checkpoint's groups")
    p.add_argument("--output", default="bench_blocks.jsonl")
    return p


def _graph_us(fn, calls: int) -> float:
    """GPU microseconds a call of `fn`, as `calls` calls in one replayed CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def _default_launch(x: torch.Tensor, qw) -> tuple:
    """The launch shape `blocks.blocks_matmul` takes by default: blocks_tc.py's or
    blocks_x16.py's where they take the product (their `takes`), else `blocks.config`'s."""
    from specserve.kernels import blocks, blocks_tc, blocks_x16

    n, k = qw.shape
    if blocks_tc.takes(x, qw):
        return blocks_tc.config(n, k, 0 if qw.method == "q8" else qw.group // 32, x.shape[0])
    if blocks_x16.takes(x, qw):
        return blocks_x16.config(n, blocks_x16.scale_span(qw)[0])
    return blocks.config(n, k, qw.group, x.shape[0], qw.method)


def _weight(w: torch.Tensor, form: str, q4_group: int):
    """w as the layer's blocks: q8 (Q8_0) or q4, Q4_1's or an int4 checkpoint's groups."""
    from specserve.core import quant
    from specserve.models.quant_int4 import quantize_int4

    if form == "q8" or q4_group == 32:
        return quant.quantize_blocks(w, form)
    return quant.int4_to_q4(quantize_int4(w, q4_group, scale_dtype=torch.float16))


def main(argv: list[str] | None = None) -> int:
    from specserve import kernels
    from specserve.kernels import blocks

    args = _parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("specserve bench blocks needs a CUDA GPU")
    launch = None
    if args.launch:
        block_n, groups, warps = (int(v) for v in args.launch.split(","))
        launch = (block_n, groups, warps)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, n, k, form in layer_shapes(args.shape):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
        qw = _weight(w, form, args.q4_group)
        stored = sum(t.numel() * t.element_size() for t in (qw.data, qw.scale, qw.zeros) if t is not None)
        for t in (int(v) for v in args.tokens.split(",")):
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16, generator=gen)
            with kernels.fused_kernels(True):
                bf16_us = _graph_us(lambda x=x, w=w: kernels.gemv(x, w), args.calls)
            blocks_us = _graph_us(lambda x=x, qw=qw: blocks.blocks_matmul(x, qw, launch=launch), args.calls)
            row = {"bench": "blocks", "shape": args.shape, "layer": name, "rows": n, "cols": k, "form": form,
                   "q4_group": args.q4_group if form == "q4" else None,
                   "tokens": t, "bf16_us": bf16_us, "blocks_us": blocks_us, "speed_vs_bf16": bf16_us / blocks_us,
                   "blocks_GBps": stored / blocks_us / 1e3, "bf16_GBps": n * k * 2 / bf16_us / 1e3,
                   "launch": list(launch or _default_launch(x, qw)),
                   "device": torch.cuda.get_device_name(dev)}
            report(f"blocks: {args.shape} {name} [{n}, {k}] {form} T={t}: blocks {blocks_us:.1f} us "
                   f"({row['blocks_GBps']:.0f} GB/s), bf16 {bf16_us:.1f} us ({row['bf16_GBps']:.0f} GB/s): "
                   f"{row['speed_vs_bf16']:.2f}x bf16's speed", row, args.output)
    return 0
