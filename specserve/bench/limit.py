"""`specserve bench limit`: how close batch-1 decode gets to the GPUs' memory bandwidth.

A Llama-3.1-8B-shaped model (or --shape 70b; smollm2 and qwen2.5-1.5b, the shapes of the
default model and of the catalogue's 1.5B) with random bf16 weights (--load-format dummy:
made on the device, no download) decodes after a short prompt at batch size 1 through the server's own
Scheduler (its attention backend, CUDA graphs and overlapped decode; and once more with
overlap off, in the same run). Achieved bandwidth = bytes one step must read (every weight
once, one embedding row, the KV so far) / step time, compared with a device-to-device copy
measured in the same run ((read + write) bytes / time). It also times a verify forward of
a 16-node tree against one decode step on the same model two ways: through the bare
runner with a read-back after each (host work included; the verify of a speculative step
is read back at once), and as the GPU time of their captured graphs' replays (CUDA
events, the two graphs alternated in blocks), which host noise does not move.

With --quantizations none,fp8 each weight format runs in turn (ratios to the first), and
with --deterministic off,on the model without and with --enable-deterministic-inference;
the bytes a step reads are the weights as stored. With --tp-sizes 1,2 (or 4) each size
runs in turn, sharded over GPUs 0..N-1 (one process
a rank, bench/ranks.py); the bandwidth is every rank's bytes over the step time, against
the GPUs' summed copy rate, and each size's speed is also given as a ratio to the first.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from specserve import kernels
from specserve.bench.ranks import run_on_ranks
from specserve.bench.report import report

VERIFY_NODES = 16  # the verify(16) <= 1.15x decode target
CONTEXT_LENGTH = 4096  # the served model's context: a prompt, its timed steps and a verify fit in it
WARM_STEPS = 8  # decode steps before each timing
LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


LLAMA_31_70B: dict[str, Any] = {**LLAMA_31_8B, "hidden_size": 8192, "intermediate_size": 28672,
                                 "num_hidden_layers": 80, "num_attention_heads": 64}
SMOLLM2_135M: dict[str, Any] = {  # the default model's shape: launches, not bytes, set its pace
    "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}
QWEN25_15B: dict[str, Any] = {  # the catalogue's 1.5B (Qwen2: q/k/v bias, 151936 tokens)
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
    "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 151936,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768, "attention_bias": True,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
SHAPES = {"8b": LLAMA_31_8B, "70b": LLAMA_31_70B, "smollm2": SMOLLM2_135M, "qwen2.5-1.5b": QWEN25_15B}
NAMES = {"8b": "llama-3.1-8b", "70b": "llama-3.1-70b", "smollm2": "smollm2-135m", "qwen2.5-1.5b": "qwen2.5-1.5b"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench limit")
    p.add_argument("--shape", default="8b", choices=tuple(SHAPES),
                   help="shape of the random model: Llama-3.1 8B or 70B, SmolLM2-135M, Qwen2.5-1.5B")
    p.add_argument("--tp-sizes", default="1",
                   help="tensor-parallel sizes to time in turn, e.g. 1,2 (each on GPUs 0..N-1, one process each)")
    p.add_argument("--quantizations", default="none",
                   help="weight quantizations to time in turn, e.g. none,fp8 (the first is the ratios' base)")
    p.add_argument("--deterministic", default="off",
                   help="--enable-deterministic-inference off and/or on, timed in turn, e.g. off,on")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_e4m3"))
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


def step_bytes(model, kv_len: int, kv_element: int) -> int:
    """Bytes one decode step reads on this rank: its weights as stored (fp8 scales too) but
    the input embedding (one row), plus its KV (`kv_element` bytes a value)."""
    from specserve.models.quantization import weight_bytes

    c = model.config
    weights, _ = weight_bytes(model)
    kv = 2 * c.num_layers * c.kv_heads_per_rank * c.head_dim * kv_len * kv_element
    return weights + c.hidden_size * model.model.embed_tokens.weight.element_size() + kv


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    room = CONTEXT_LENGTH - WARM_STEPS - VERIFY_NODES - 2  # a sampled first token, a verify's root
    if args.prompt_len < 1 or args.steps < 1 or args.prompt_len + args.steps > room:
        parser.error(f"--prompt-len ({args.prompt_len}) and --steps ({args.steps}) must be at least 1 and "
                     f"add up to at most {room}: the model's context is {CONTEXT_LENGTH} tokens")
    sizes = [int(t) for t in args.tp_sizes.split(",")]
    runs = [(q, det, tp) for q in args.quantizations.split(",") for det in args.deterministic.split(",")
            for tp in sizes]
    first: dict | None = None
    for q, det, tp in runs:
        args.quantization, args.invariant = (None if q == "none" else q), det == "on"
        row = _measure(args) if sizes == [1] else _combine(run_on_ranks(_measure, tp, args))
        first = first or row
        row["tp_size"], row["speedup_vs_first"] = tp, row["tok_s"] / first["tok_s"]
        row["deterministic"] = args.invariant
        report(f"limit: {args.shape}-shaped bf16 weights {q} KV {args.kv_cache_dtype} TP {tp} "
               f"deterministic {det} bs=1 "
               f"{row['tok_s']:.1f} tok/s ({row['step_ms']:.2f} ms/step, "
               f"{row['speedup_vs_first']:.2f}x the first run), {row['achieved_GBps']:.0f} GB/s = "
               f"{100 * row['fraction_of_copy']:.1f}% of copy {row['copy_GBps']:.0f} GB/s (no overlap: "
               f"{row['no_overlap_step_ms']:.2f} ms, {100 * row['no_overlap_fraction']:.1f}%); verify(16) = "
               f"{row['verify16_over_decode']:.2f}x a decode step "
               f"({_graph_note((row['graph_decode_us'], row['graph_verify16_us']))}) "
               f"({row['attention_backend']}, graphs {'on' if row['cuda_graphs'] else 'off'}, "
               f"PDL {'on' if row['pdl'] else 'off'}, TMA {'on' if row['tma'] else 'off'}, {row['device']})",
               row, args.output)
    return 0


def _combine(rows: list[dict]) -> dict:
    """Rank 0's timings; bytes and copy bandwidth summed over the ranks (each its GPU's)."""
    row = dict(rows[0])
    for key in ("achieved_GBps", "copy_GBps"):
        row[key] = sum(r[key] for r in rows)
    row["fraction_of_copy"] = row["achieved_GBps"] / row["copy_GBps"]
    row["no_overlap_fraction"] = sum(r["no_overlap_fraction"] * r["copy_GBps"] for r in rows) / row["copy_GBps"]
    return row


def _measure(args: argparse.Namespace) -> dict:
    """Every figure of one model on this process's GPU (one rank of a group, or alone)."""
    device = torch.device("cuda")
    copy_bw = copy_bandwidth(device)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(SHAPES[args.shape]))
        sched = _scheduler(Path(tmp), args)
    runner, model = sched.runner, sched.runner.model
    # A server without a draft captures no VERIFY graphs: capture them too (a speculative
    # server verifies through its graphs), so verify(16) is timed as it would serve.
    runner.capture_cuda_graphs(sched.kv.table.table, sched.max_running, verify_tokens=VERIFY_NODES)
    ids = [(1000 + i) % runner.vocab_size for i in range(args.prompt_len)]
    _served_decode(sched, ids, WARM_STEPS, overlap=True)  # warm-up: Triton compiles, graphs replay once
    overlap_s = _served_decode(sched, ids, args.steps, overlap=True)
    plain_s = _served_decode(sched, ids, args.steps, overlap=False)
    step_s, kv_mid, verify_ratio, graph_us = _decode(runner, sched.kv, args.prompt_len, args.steps)
    weights = step_bytes(model, kv_mid, runner.kv_pool.k[0].element_size())
    bw = weights / overlap_s
    return {"bench": "limit", "model": f"{NAMES[args.shape]}-shaped", "dtype": "bfloat16", "batch_size": 1,
            "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype, "step_bytes": weights,
            "device": torch.cuda.get_device_name(device), "attention_backend": type(runner.attn_backend).__name__,
            "cuda_graphs": runner.graphs is not None, "pdl": kernels.pdl_enabled(device),
            "tma": kernels.tma_enabled(device), "tok_s": 1 / overlap_s, "step_ms": 1e3 * overlap_s,
            "achieved_GBps": bw / 1e9, "copy_GBps": copy_bw / 1e9, "fraction_of_copy": bw / copy_bw,
            "no_overlap_step_ms": 1e3 * plain_s, "no_overlap_fraction": weights / plain_s / copy_bw,
            "runner_loop_step_ms": 1e3 * step_s, "verify16_over_decode": verify_ratio,
            "graph_decode_us": graph_us[0], "graph_verify16_us": graph_us[1],
            "graph_verify16_over_decode": graph_us[1] / graph_us[0] if graph_us[0] else None,
            "prompt_len": args.prompt_len, "steps": args.steps}


def _scheduler(model_dir: Path, args: argparse.Namespace):
    """The server's scheduler on random weights (--load-format dummy) of the chosen shape."""
    from specserve.args import parse_config
    from specserve.engine.protocol import EngineStart
    from specserve.engine.scheduler import Scheduler

    argv = ["--model-path", str(model_dir), "--load-format", "dummy", "--dtype", "bfloat16",
            "--context-length", str(CONTEXT_LENGTH), "--max-total-tokens", "16384", "--max-running-requests", "4",
            "--disable-radix-cache", "--log-level", "warning",
            "--cuda-graph-max-prefill-tokens", "0"]  # decode is timed: no prefill graphs to capture
    if args.attention_backend:
        argv += ["--attention-backend", args.attention_backend]
    if args.quantization:
        argv += ["--quantization", args.quantization]
    argv += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.disable_cuda_graph:
        argv.append("--disable-cuda-graph")
    if getattr(args, "invariant", False):
        argv.append("--enable-deterministic-inference")
    start = EngineStart(parse_config(argv), model_dir, model_dir)  # no tokenizer files: a word tokenizer
    return Scheduler(start, _word_tokenizer(SHAPES[args.shape]["vocab_size"]))


def _word_tokenizer(vocab_size: int):
    """A real tokenizer over made-up words "t0".."t{V-1}": random weights come with none,
    and the scheduler detokenizes what it streams."""
    import tokenizers

    from specserve.tokenizer.tokenizer import Tokenizer

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return Tokenizer(tok, bos_token_id=None, eos_token_ids=frozenset(), add_bos_token=False, chat_template=None,
                     special_tokens={})


def _served_decode(sched, ids: list[int], steps: int, overlap: bool) -> float:
    """Seconds per decode step of one request through the scheduler, as the server runs
    it (host work, read-back and output processing included), with or without overlap."""
    from specserve.core.messages import GenerateReq
    from specserve.core.sampling_params import SamplingParams

    sched.overlap = overlap
    params = SamplingParams(temperature=0, max_new_tokens=steps + 1, ignore_eos=True)
    sched.add_request(GenerateReq(f"limit-{overlap}-{steps}", ids, params))
    sched.step()  # the prefill (samples the first token)
    tokens, start = 0, time.perf_counter()
    while sched.has_work:
        tokens += sum(len(out.token_ids) for out in sched.step())
    return (time.perf_counter() - start) / tokens


def _graph_note(graph_us: tuple[float, float]) -> str:
    decode, verify = graph_us
    if not decode:
        return "no graphs"
    return f"graphs: {verify:.0f} / {decode:.0f} us = {verify / decode:.3f}x"


def _decode(runner, kv, prompt_len: int, steps: int) -> tuple[float, int, float, tuple[float, float]]:
    """The runner alone, each step read back before the next: seconds per decode step
    (host included), the mean KV length, verify(16) / decode timed the same way, and
    the (decode, verify) graphs' GPU time in us ((0, 0) without graphs)."""
    from specserve.core.batch import ScheduleBatch
    from specserve.core.forward_batch import ForwardMode
    from specserve.core.request import Req
    from specserve.core.sampling_params import SamplingParams

    ids = [(1000 + i) % runner.vocab_size for i in range(prompt_len)]
    req = Req("limit", ids, SamplingParams(temperature=0), 0, None, None)
    kv.admit(req)
    slots = kv.extend(req, prompt_len)
    batch = ScheduleBatch(ForwardMode.EXTEND, [req], req.prompt_ids, slots, [0], [prompt_len], [True])
    req.output_ids.append(_argmax(runner, kv, batch))

    def decode() -> None:
        prefix = req.kv_len
        s = kv.extend(req, 1)
        b = ScheduleBatch(ForwardMode.DECODE, [req], [req.last_id], s, [prefix], [1], [True])
        req.output_ids.append(_argmax(runner, kv, b))

    for _ in range(WARM_STEPS):
        decode()
    kv_start, start = req.kv_len, time.perf_counter()
    for _ in range(steps):
        decode()
    step_s = (time.perf_counter() - start) / steps
    kv_mid = (kv_start + req.kv_len) // 2
    slots = kv.alloc_slots(VERIFY_NODES)
    ratio = _verify_ratio(runner, kv, req, slots, step_s)
    graph_us = _graph_times(runner)  # each graph's metadata is its last forward's, above
    kv.allocator.free(slots)
    kv.release(req)
    return step_s, kv_mid, ratio, graph_us


def _graph_times(runner, blocks: int = 7, iters: int = 40) -> tuple[float, float]:
    """Median GPU us of a DECODE and a VERIFY graph replay at batch 1, alternated in
    `blocks` blocks of `iters` replays. Each replays on the metadata of its last forward
    (they keep separate buffers) and rewrites that forward's K/V: same values, same slots."""
    from specserve.core.forward_batch import ForwardMode

    graphs = runner.graphs.graphs if runner.graphs is not None else {}
    decode, verify = graphs.get((ForwardMode.DECODE, 1)), graphs.get((ForwardMode.VERIFY, 1))
    if decode is None or verify is None:
        return 0.0, 0.0
    pair = decode, verify
    times: tuple[list[float], list[float]] = ([], [])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(blocks):
        for graph, out in zip(pair, times):
            start.record()
            for _ in range(iters):
                graph.replay()
            end.record()
            end.synchronize()
            out.append(1e3 * start.elapsed_time(end) / iters)
    decode_us, verify_us = (sorted(t)[len(t) // 2] for t in times)
    return decode_us, verify_us


def _verify_ratio(runner, kv, req, slots: torch.Tensor, decode_s: float, nodes: int = VERIFY_NODES,
                  iters: int = 20) -> float:
    """A VERIFY forward of a 16-node tree (4 chains of 4 under the root, at `slots`) / one decode step."""
    from specserve.spec.drafts import Drafts
    from specserve.spec.verify import verify_batch

    parents = [-1] + [0 if i % 4 == 1 else i - 1 for i in range(1, nodes)]
    tokens = [(2000 + i) % runner.vocab_size for i in range(nodes - 1)]
    drafts = Drafts.from_lists([[req.last_id] + tokens], [parents])
    kv.table.write(req.row, req.kv_len, slots)
    batch = verify_batch([req], drafts, [slots], full=runner.verify_graph_tokens == nodes)
    for _ in range(3):
        _argmax(runner, kv, batch)
    start = time.perf_counter()
    for _ in range(iters):
        _argmax(runner, kv, batch)
    return (time.perf_counter() - start) / iters / decode_s


def _argmax(runner, kv, batch) -> int:
    """One forward; the argmax of the last logits row (a device->host sync, as in serving)."""
    fb = runner.forward_batch(batch, kv.table.table)
    return int(runner.forward(fb)[-1].argmax())


if __name__ == "__main__":
    raise SystemExit(main())
