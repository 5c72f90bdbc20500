"""`specserve bench limit`: how close batch-1 decode gets to the GPU's memory bandwidth.

A Llama-3.1-8B-shaped model with random bf16 weights (made on the device, no download)
decodes after a short prompt at batch size 1 through the engine's own ModelRunner (its
attention backend and CUDA graphs). Achieved bandwidth = bytes one step must read (every
weight once, one embedding row, the KV so far) / step time, compared with a
device-to-device copy measured in the same run ((read + write) bytes / time). It also
times a verify forward of a 16-node tree against one decode step on the same model.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from specserve.bench.report import report

VERIFY_NODES = 16  # the verify(16) <= 1.15x decode target
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench limit")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--attention-backend", default=None, choices=("torch", "triton"))
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--output", default="bench_limit.jsonl")
    return p


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Bytes/s of a device-to-device copy, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    return 2 * nbytes * iters / (start.elapsed_time(end) / 1e3)


def step_bytes(model, kv_len: int) -> int:
    """Bytes one decode step reads: all weights but the embedding (one row), plus the KV."""
    c = model.config
    size = next(model.parameters()).element_size()
    weights = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n) * size
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * kv_len * size
    return weights + c.hidden_size * size + kv


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from specserve.config import CacheConfig, ModelConfig, RunnerConfig
    from specserve.engine.kv_manager import KVManager
    from specserve.models.loader import random_model
    from specserve.runner.model_runner import ModelRunner

    device = torch.device("cuda")
    copy_bw = copy_bandwidth(device)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(LLAMA_31_8B))
        model = random_model(Path(tmp), torch.bfloat16, device)
        runner = ModelRunner(Path(tmp), ModelConfig(device="cuda", dtype="bfloat16", context_length=4096),
                             CacheConfig(max_total_tokens=16384),
                             RunnerConfig(attention_backend=args.attention_backend,
                                          disable_cuda_graph=args.disable_cuda_graph), model=model)
    kv = KVManager(runner.num_slots, 4, 4096 + 32, device, enable_prefix_cache=False)
    runner.capture_cuda_graphs(kv.table.table, 1, verify_tokens=VERIFY_NODES)
    step_s, kv_mid, verify_ratio = _decode(runner, kv, args.prompt_len, args.steps)
    bw = step_bytes(model, kv_mid) / step_s
    row = {"bench": "limit", "model": "llama-3.1-8b-shaped", "dtype": "bfloat16", "batch_size": 1,
           "device": torch.cuda.get_device_name(device), "attention_backend": type(runner.attn_backend).__name__,
           "cuda_graphs": runner.graphs is not None, "tok_s": 1 / step_s, "step_ms": 1e3 * step_s,
           "achieved_GBps": bw / 1e9, "copy_GBps": copy_bw / 1e9, "fraction_of_copy": bw / copy_bw,
           "verify16_over_decode": verify_ratio, "prompt_len": args.prompt_len, "steps": args.steps}
    report(f"limit: 8B-shaped bf16 bs=1 {row['tok_s']:.1f} tok/s ({row['step_ms']:.2f} ms/step), "
           f"{row['achieved_GBps']:.0f} GB/s = {100 * row['fraction_of_copy']:.1f}% of copy "
           f"{row['copy_GBps']:.0f} GB/s; verify(16) = {verify_ratio:.2f}x a decode step "
           f"({row['attention_backend']}, graphs {'on' if row['cuda_graphs'] else 'off'}, {row['device']})",
           row, args.output)
    return 0


def _decode(runner, kv, prompt_len: int, steps: int) -> tuple[float, int, float]:
    """Seconds per decode step (host included), the mean KV length, verify(16)/decode."""
    from specserve.engine.batch import ScheduleBatch
    from specserve.engine.request import Req
    from specserve.engine.sampling_params import SamplingParams
    from specserve.runner.forward_batch import ForwardMode

    ids = [(1000 + i) % runner.vocab_size for i in range(prompt_len)]
    req = Req("limit", ids, SamplingParams(temperature=0), 0, None, None)
    kv.admit(req)
    slots = kv.extend(req, prompt_len)
    batch = ScheduleBatch(ForwardMode.EXTEND, [req], req.prompt_ids, slots, [0], [prompt_len], [True])
    req.output_ids.append(_argmax(runner, kv, batch))

    def decode() -> None:
        prefix = req.kv_len
        s = kv.extend(req, 1)
        b = ScheduleBatch(ForwardMode.DECODE, [req], [req.all_ids[-1]], s, [prefix], [1], [True])
        req.output_ids.append(_argmax(runner, kv, b))

    for _ in range(8):  # warm-up
        decode()
    kv_start, start = req.kv_len, time.perf_counter()
    for _ in range(steps):
        decode()
    step_s = (time.perf_counter() - start) / steps
    kv_mid = (kv_start + req.kv_len) // 2
    ratio = _verify_ratio(runner, kv, req, step_s)
    kv.release(req)
    return step_s, kv_mid, ratio


def _verify_ratio(runner, kv, req, decode_s: float, nodes: int = 16, iters: int = 20) -> float:
    """A VERIFY forward of a 16-node tree (4 chains of 4 under the root) / one decode step."""
    from specserve.spec.drafts import Drafts
    from specserve.spec.verify import verify_batch

    parents = [-1] + [0 if i % 4 == 1 else i - 1 for i in range(1, nodes)]
    tokens = [(2000 + i) % runner.vocab_size for i in range(nodes - 1)]
    drafts = Drafts.from_lists([[req.all_ids[-1]] + tokens], [parents])
    slots = kv.alloc_slots(nodes)
    kv.table.write(req.row, req.kv_len, slots)
    batch = verify_batch([req], drafts, [slots], full=runner.verify_graph_tokens == nodes)
    for _ in range(3):
        _argmax(runner, kv, batch)
    start = time.perf_counter()
    for _ in range(iters):
        _argmax(runner, kv, batch)
    kv.allocator.free(slots)
    return (time.perf_counter() - start) / iters / decode_s


def _argmax(runner, kv, batch) -> int:
    """One forward; the argmax of the last logits row (a device->host sync, as in serving)."""
    fb = runner.forward_batch(batch, kv.table.table)
    return int(runner.forward(fb)[-1].argmax())


if __name__ == "__main__":
    raise SystemExit(main())
