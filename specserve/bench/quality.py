"""`specserve bench quality`: how far a quantized model's greedy text is from the float model's.

The model is served twice by the offline Engine, one after the other: in its own dtype, then
with `--quantization` (or `--kv-cache-dtype`). Both answer the same MT-bench first turns
greedily; the row counts the answers that are token-identical, those whose first token
agrees, and the mean length of the common prefix. The float side is the model's float weights
(`--quantization none`: a GGUF too, which the CPU would otherwise serve in its blocks).

`--kl-questions N` also loads both models outside the engines and reports the mean next-token
KL(float || quantized) over every position of the first N prompts followed by the float
side's answers (bench/score.py; weights only: the KV cache's dtype does not enter it).
"""
from __future__ import annotations

import argparse
import gc

from specserve.bench.prompts import mt_bench_first_turns
from specserve.bench.report import report


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench quality")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quantization", default="fp8", help="the quantized side's --quantization (none: float)")
    p.add_argument("--kv-cache-dtype", default="auto", help="the quantized side's --kv-cache-dtype")
    p.add_argument("--num-questions", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help="each engine's share of GPU memory (the two run one after the other)")
    p.add_argument("--kl-questions", type=int, default=0,
                   help="the mean next-token KL over the first N prompts and the float answers (0: not measured)")
    p.add_argument("--output", default="bench_quality.jsonl")
    return p


def common_prefix(a: list[int], b: list[int]) -> int:
    """Tokens a and b share from the start."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _answers(args: argparse.Namespace, prompts: list[str], **flags) -> tuple[list[list[int]], list[list[int]], dict]:
    """The prompts' ids, the greedy output ids of every prompt, and the engine's weight report."""
    from specserve import Engine

    engine = Engine(args.model, log_level="warning", device=args.device, dtype=args.dtype,
                    mem_fraction_static=args.mem_fraction_static, **flags)
    ids = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    outs = [o["output_ids"] for o in engine.generate(input_ids=ids, sampling_params=params)]
    info = engine.server_info()["weight_quantization"]
    del engine
    gc.collect()
    free_gpu()
    return ids, outs, info


def _mean_kl(args: argparse.Namespace, quant: str | None, seqs: list[list[int]]) -> float:
    """Mean over `seqs` of each one's mean next-token KL(float || quantized)."""
    from specserve.bench.score import mean_kl, position_logprobs
    from specserve.models.loader import load_model, pick_dtype, read_hf_config
    from specserve.models.source import resolve_model_dir
    from specserve.runner.model_runner import pick_device

    model_dir = resolve_model_dir(args.model)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device, read_hf_config(model_dir))
    model = load_model(model_dir, dtype, device, "none")
    ref = [position_logprobs(model, ids).cpu() for ids in seqs]  # on the host: one model at a time
    del model
    gc.collect()
    free_gpu()
    model = load_model(model_dir, dtype, device, quant or "none")
    kls = [mean_kl(r, position_logprobs(model, ids).cpu()) for r, ids in zip(ref, seqs)]
    del model
    gc.collect()
    free_gpu()
    return sum(kls) / len(kls)


def free_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    prompts = mt_bench_first_turns(args.num_questions)
    prompt_ids, base, _ = _answers(args, prompts, quantization="none")
    quant = None if args.quantization == "none" else args.quantization
    _, other, info = _answers(args, prompts, quantization=quant, kv_cache_dtype=args.kv_cache_dtype)
    prefixes = [common_prefix(a, b) for a, b in zip(base, other)]
    n = len(prompts)
    row = {"bench": "quality", "model": args.model, "quantization": args.quantization,
           "kv_cache_dtype": args.kv_cache_dtype, "prompts": n, "max_new_tokens": args.max_new_tokens,
           "identical": sum(a == b for a, b in zip(base, other)), "first_token_equal": sum(p > 0 for p in prefixes),
           "mean_common_prefix": sum(prefixes) / n, "weights": info}
    kl = ""
    if args.kl_questions > 0:
        ids = [p + out for p, out in zip(prompt_ids[:args.kl_questions], base)]
        row["kl_questions"] = len(ids)
        row["mean_kl"] = _mean_kl(args, quant, ids)
        kl = f", mean next-token KL {row['mean_kl']:.4f} nats over {len(ids)} prompts and answers"
    report(f"quality: {args.model} weights {args.quantization} KV {args.kv_cache_dtype} against float, "
           f"{n} MT-bench prompts x {args.max_new_tokens} greedy tokens: identical {row['identical']}/{n}, "
           f"first token equal {row['first_token_equal']}/{n}, mean common prefix {row['mean_common_prefix']:.1f} "
           f"({info['bytes_per_weight']} bytes a weight){kl}", row, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
