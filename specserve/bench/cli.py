"""`specserve bench <name>`: dispatch to one benchmark; `specserve bench --help` lists them."""
from __future__ import annotations

import importlib
import sys

# name -> (module, what it measures); each module's main(argv) has its own --help
BENCHES: dict[str, tuple[str, str]] = {
    "compare": ("specserve.bench.compare", "our engine against Hugging Face transformers generate"),
    "cpu": ("specserve.bench.cpu", "one GGUF on the CPU: float, its blocks, NGRAM, EAGLE-3, transformers, llama.cpp"),
    "spec": ("specserve.bench.spec_compare", "the same engine with and without speculation, in one run"),
    "speculative": ("specserve.bench.speculative", "SGLang's bench_speculative sweep over tree shapes"),
    "serving": ("specserve.bench.serving", "concurrent clients against the real HTTP server"),
    "soak": ("specserve.bench.soak", "N streaming clients for T seconds against a server it starts: no 5xx, "
             "back to idle, bounded memory, greedy answers unchanged"),
    "mtbench": ("specserve.bench.mtbench", "MT-bench: plain against EAGLE-2 / EAGLE-3 / NGRAM (+ HF)"),
    "limit": ("specserve.bench.limit", "batch-1 decode against the GPUs' memory bandwidth (8B/70B shape, TP sizes)"),
    "allreduce": ("specserve.bench.allreduce", "a tensor-parallel all-reduce: NCCL against symmetric memory"),
    "blocks": ("specserve.bench.blocks", "the GGUF-block kernel against the bf16 kernels at a model shape's layers"),
    "quality": ("specserve.bench.quality", "a quantized model's greedy text against the float model's"),
    "structured": ("specserve.bench.structured", "JSON-schema answers with and without speculation; the mask's cost"),
    "compile": ("specserve.bench.compile", "the engine with and without --enable-torch-compile"),
    "ngram-cost": ("specserve.bench.ngram_cost", "the NGRAM proposer's CPU cost per decode step"),
    "governor-sim": ("specserve.bench.governor_sim", "the speculation governor on a simulated batch-1 round"),
}


def usage() -> str:
    width = max(map(len, BENCHES))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in BENCHES.items()]
    return ("usage: specserve bench <name> [args]   (specserve bench <name> --help for its flags)\n\n"
            "benchmarks:\n" + "\n".join(lines))


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in BENCHES:
        if argv:
            print(f"error: unknown benchmark {argv[0]!r}\n", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 2
    return importlib.import_module(BENCHES[argv[0]][0]).main(argv[1:])
