"""The training run: regenerate, pick the vocabulary, distil, write the head.

`train_draft(cfg)` owns the order of the stages and the run's files in `cfg.output`:

    regen.json, prompts.jsonl, shards/   on-policy answers (regen.py)
    train_log.jsonl                      one line per optimizer step: loss, loss_j, acc_j, lr, tok/s
    val_log.jsonl                        held-out loss and acc_j at every save (sequences never trained on)
    train_state.pt                       everything a resumed run needs (params, AdamW, LR
                                         schedule, step, epoch, batch, vocab, RNG)
    config.json, model.safetensors       the head, in the published layout (written at
                                         every save, so an interrupted run leaves a usable one)

Optimisation: AdamW over the head's own parameters (fp32 master weights), LR linear
warm-up then cosine decay to zero over the run's steps, gradient clipping, bf16 autocast
on CUDA and plain fp32 on CPU. The run's length is `max_steps` if given, else `epochs`
passes over the data. A resumed run rebuilds the same epoch plans and continues at the
next batch; its steps equal an uninterrupted run's (the tests check this on CPU).
`time_limit` bounds one invocation's wall clock, regeneration included: when it is up
during regeneration no new shard starts (RegenIncomplete), during training the loop saves
and returns, so a run on a time-limited machine ends at a checkpoint and continues with
`resume`. `max_steps` may change on resume (the cosine follows the new total).
`init_from` starts the head from a published one (weights, draft vocabulary, specserve_*
config keys) instead of a fresh initialisation; a resumed run restores its own state.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specserve.models.llama import LlamaForCausalLM
from specserve.models.loader import DTYPES, load_model, pick_dtype, read_hf_config
from specserve.models.source import resolve_model_dir
from specserve.runner.model_runner import pick_device
from specserve.train import draft as heads
from specserve.train.batching import collate, plan_epoch, split_validation
from specserve.train.features import Teacher
from specserve.train.loss import Objective, StepStats, answer_rows
from specserve.train.regen import META, RegenConfig, Sequence, load_sequences, regenerate
from specserve.train.vocab import DraftVocab, answer_token_counts, build_draft_vocab

logger = logging.getLogger("specserve")

STATE, LOG, VAL_LOG = "train_state.pt", "train_log.jsonl", "val_log.jsonl"
# Settings a resumed run must share with the run it continues.
_RESUME_KEYS = ("model", "algorithm", "dataset", "num_prompts", "max_new_tokens", "max_seq_len",
                "draft_vocab_size", "ttt_steps", "batch_tokens", "batch_size", "val_size", "seed",
                "extra_temperatures", "init_from", "turns")


@dataclass(frozen=True)
class TrainConfig:
    model: str
    algorithm: str  # "EAGLE3" or "EAGLE" (EAGLE-2)
    output: Path
    dataset: str = "sharegpt"
    num_prompts: int = 2000
    max_new_tokens: int = 512
    max_seq_len: int = 2048
    temperature: float = 0.0
    extra_temperatures: tuple[float, ...] = ()  # one more sampled answer per prompt at each
    turns: str = "first"  # "all": every user turn with its conversation before it (data.py)
    draft_vocab_size: int = 32000  # EAGLE3 only; capped at the target's vocabulary
    ttt_steps: int = 7
    step_decay: float = 0.8
    epochs: int = 1
    max_steps: int | None = None
    lr: float = 1e-3  # peak AdamW learning rate (after the warm-up); the default chosen on held-out acc_j
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    batch_tokens: int = 8192
    batch_size: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    save_dtype: str = "bfloat16"
    tokenizer_path: str | None = None
    shard_size: int = 256
    save_every: int = 500
    val_size: int | None = None  # held-out sequences; None: 2% of them, at most 64
    resume: bool = False
    seed: int = 0
    engine_args: dict[str, Any] = field(default_factory=dict)  # extra Engine flags for regeneration
    time_limit: float | None = None  # seconds for this invocation; then save and stop (None: no limit)
    init_from: str | None = None  # a head in the published layout to start from (its weights and vocabulary)


@dataclass
class TrainResult:
    output: Path
    steps: int
    loss: float  # mean weighted loss over the last steps (up to 20)
    acc: list[float]  # per TTT step, same window
    tokens: int  # sequence tokens trained on in this invocation
    vocab_coverage: float | None  # EAGLE3: share of answer tokens inside the draft vocabulary
    val_acc: list[float] | None = None  # per TTT step on the held-out sequences (None: no hold-out)
    peak_gib: float | None = None  # CUDA: peak memory allocated by this process


@dataclass
class _Progress:
    step: int = 0
    epoch: int = 0
    batch: int = 0  # next batch of the epoch's plan


def train_draft(cfg: TrainConfig) -> TrainResult:
    deadline = time.monotonic() + cfg.time_limit if cfg.time_limit is not None else math.inf
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    _check_resume(out, cfg)
    model_dir = resolve_model_dir(cfg.model)
    device = pick_device(cfg.device)
    hf = read_hf_config(model_dir)
    eos = regenerate(out, _regen_config(cfg), lambda: _engine(model_dir, cfg), deadline)
    gc.collect()  # the regeneration engine (KV pool, CUDA graphs) is garbage now: free it first
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)  # report training's peak, not the engine's
    seqs = load_sequences(out)
    logger.info("%d sequences, %d answer tokens", len(seqs), sum(s.answer_len for s in seqs))
    target = load_model(model_dir, pick_dtype(cfg.dtype, device, hf), device)
    run = _Run(cfg, out, hf, target, seqs, eos)
    return run.train(deadline)


def _check_resume(out: Path, cfg: TrainConfig) -> None:
    if (out / STATE).is_file() and not cfg.resume:
        raise ValueError(f"{out} already holds a training run ({STATE}): pass --resume to continue it, "
                         "or choose another --output")
    if cfg.resume and not (out / STATE).is_file() and not (out / META).is_file():
        raise ValueError(f"--resume: {out} has no {STATE} to resume from")  # nor answers to go on making


def _regen_config(cfg: TrainConfig) -> RegenConfig:
    return RegenConfig(cfg.model, cfg.dataset, cfg.num_prompts, cfg.max_new_tokens, cfg.max_seq_len,
                       cfg.temperature, cfg.seed, cfg.shard_size, tuple(cfg.extra_temperatures), cfg.turns)


def _engine(model_dir: Path, cfg: TrainConfig) -> Any:
    from specserve import Engine  # the serving stack, only when answers must be generated

    return Engine(str(model_dir), device=cfg.device, dtype=cfg.dtype, tokenizer_path=cfg.tokenizer_path,
                  random_seed=cfg.seed, log_level="warning", **cfg.engine_args)


class _Run:
    """One invocation's state: the head, its optimiser, the data and the progress."""

    def __init__(self, cfg: TrainConfig, out: Path, hf: dict, target: LlamaForCausalLM,
                 seqs: list[Sequence], eos: list[int]) -> None:
        self.cfg, self.out, self.seqs = cfg, out, seqs
        self.device = target.model.embed_tokens.weight.device
        self.eagle3 = cfg.algorithm == heads.EAGLE3
        resumed = cfg.resume and (out / STATE).is_file()  # else only the regeneration was cut short
        saved = torch.load(out / STATE, weights_only=True) if resumed else None
        if saved is not None:
            _check_same_run(saved["config"], cfg)
        # a resumed run restores its own parameters: the head it started from is read only at the start
        init = heads.read_head(Path(cfg.init_from)) if cfg.init_from and saved is None else None
        self.vocab, self.coverage = self._vocab(target.config.vocab_size, eos, saved, init)
        aux = heads.default_aux_layers(target.config.num_layers) if self.eagle3 else ()
        self.save_dtype = DTYPES[cfg.save_dtype]
        self.head_cfg = heads.head_config(hf, cfg.algorithm, self.vocab, aux, self.save_dtype)
        if cfg.init_from:  # the head's own settings (its default trees) go on into the new one
            self.head_cfg |= heads.specserve_keys(Path(cfg.init_from))
        self.draft = heads.build_draft(self.head_cfg, cfg.algorithm, target, self.vocab, aux,
                                       cfg.max_seq_len + cfg.ttt_steps + 1, cfg.seed)
        self.teacher = Teacher(target, "aux" if self.eagle3 else "final", aux,
                               self.vocab.ids if self.vocab is not None else None)  # a vocab iff EAGLE-3
        self.objective = Objective(self.draft, cfg.step_decay, feature_loss=not self.eagle3,
                                   ce_weight=1.0 if self.eagle3 else 0.1)
        self.params = heads.trainable(self.draft)
        if init is not None:
            assert cfg.init_from is not None  # init was read from it
            heads.load_trainable(self.params, init[0], self.draft.config, Path(cfg.init_from))
        self.train_seqs, self.val_seqs = split_validation(seqs, cfg.val_size, cfg.seed)
        self.lengths = [s.ids.numel() for s in self.train_seqs]
        self.total = cfg.max_steps or sum(len(self._plan(e)) for e in range(cfg.epochs))
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=cfg.lr, betas=(0.9, 0.95),
                                           weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.progress = _Progress()
        self.recent: list[tuple[float, list[float]]] = []
        self.val_acc: list[float] | None = None
        self.evaluated_at: int | None = None  # the step val_log.jsonl last got a row for
        if saved is not None:
            self._restore(saved)
        logger.info("%s head: %.1fM trainable parameters, %d steps of <= %d tokens, %d sequences held out%s",
                    cfg.algorithm, sum(p.numel() for p in self.params.values()) / 1e6, self.total,
                    cfg.batch_tokens, len(self.val_seqs),
                    f", draft vocab {self.vocab.size} covering {100 * self.coverage:.1f}% of answer tokens"
                    if self.vocab is not None and self.coverage is not None else "")  # both or neither

    # -- setup --------------------------------------------------------------------------------
    def _vocab(self, target_vocab: int, eos: list[int], saved: dict | None,
               init: tuple[dict, torch.Tensor | None] | None) -> tuple[DraftVocab | None, float | None]:
        if not self.eagle3:
            return None, None
        counts = answer_token_counts(self.seqs, target_vocab)
        if saved is not None:
            vocab = DraftVocab(saved["vocab_ids"], target_vocab)
        elif init is not None:  # the starting head's vocabulary, not one chosen from these answers
            if init[1] is None:
                raise ValueError(f"--init-from {self.cfg.init_from}: not an EAGLE-3 head with a draft vocabulary")
            vocab = DraftVocab(init[1], target_vocab)
        else:
            vocab = build_draft_vocab(counts, self.cfg.draft_vocab_size, eos)
        return vocab, vocab.coverage(counts)

    def _plan(self, epoch: int) -> list[list[int]]:
        return plan_epoch(self.lengths, self.cfg.batch_tokens, self.cfg.batch_size, self.cfg.seed, epoch)

    def _lr_factor(self, step: int) -> float:
        """Linear warm-up over warmup_ratio of the run, then cosine decay to zero."""
        warmup = max(1, round(self.cfg.warmup_ratio * self.total))
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, self.total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    # -- the loop -----------------------------------------------------------------------------
    def train(self, deadline: float = math.inf) -> TrainResult:
        """Steps until the run's total or `deadline` (time.monotonic()), then save."""
        p, start, tokens = self.progress, time.perf_counter(), 0
        if p.step == 0 and self.cfg.init_from:
            self.evaluate()  # the starting head's held-out accuracy: what fine-tuning has to beat
        bar = tqdm(total=self.total, initial=p.step, desc=f"train {self.cfg.algorithm}", unit="step",
                   mininterval=1.0)
        with open(self.out / LOG, "a") as log:
            while p.step < self.total and time.monotonic() < deadline:
                plan = self._plan(p.epoch)
                while p.batch < len(plan) and p.step < self.total and time.monotonic() < deadline:
                    batch = [self.train_seqs[i] for i in plan[p.batch]]
                    loss, stats, grad_norm = train_step(self, batch)
                    n = sum(s.ids.numel() for s in batch)
                    p.step, p.batch, tokens = p.step + 1, p.batch + 1, tokens + n
                    rate = tokens / (time.perf_counter() - start)
                    self._record(log, loss, stats, grad_norm, n, rate)
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.3f}", acc=",".join(f"{s.acc:.2f}" for s in stats[:3]),
                                    tok_s=f"{rate:.0f}")
                    if p.step % self.cfg.save_every == 0 and p.step < self.total:
                        self.save()
                if p.batch >= len(plan):
                    p.epoch, p.batch = p.epoch + 1, 0
        bar.close()
        if p.step < self.total:
            logger.info("time limit reached at step %d of %d: saving; continue with --resume", p.step, self.total)
        self.save()
        return self._result(tokens)

    def _record(self, log, loss: float, stats: list[StepStats], grad_norm: float, tokens: int,
                rate: float) -> None:
        row = {"step": self.progress.step, "epoch": self.progress.epoch, "loss": round(loss, 5),
               "loss_j": [round(s.loss, 5) for s in stats], "acc_j": [round(s.acc, 4) for s in stats],
               "rows_j": [s.rows for s in stats], "tokens": tokens, "lr": self.scheduler.get_last_lr()[0],
               "grad_norm": round(grad_norm, 4), "tok_s": round(rate, 1)}
        if self.device.type == "cuda":
            row["mem_gib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
        log.write(json.dumps(row) + "\n")
        log.flush()
        self.recent = (self.recent + [(loss, [s.acc for s in stats])])[-20:]

    def _result(self, tokens: int) -> TrainResult:
        n = max(1, len(self.recent))
        loss = sum(r[0] for r in self.recent) / n
        acc = [sum(r[1][j] for r in self.recent) / n for j in range(self.cfg.ttt_steps)] if self.recent else []
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        return TrainResult(self.out, self.progress.step, loss, acc, tokens, self.coverage, self.val_acc, peak)

    @torch.no_grad()
    def evaluate(self) -> None:
        """Loss and acc_j on the held-out sequences (row-weighted means), logged to val_log.jsonl."""
        if not self.val_seqs or self.evaluated_at == self.progress.step:
            return
        self.evaluated_at = self.progress.step
        lengths = [s.ids.numel() for s in self.val_seqs]
        loss_sum, rows, hits = 0.0, [0] * self.cfg.ttt_steps, [0.0] * self.cfg.ttt_steps
        for idx in plan_epoch(lengths, self.cfg.batch_tokens, self.cfg.batch_size, self.cfg.seed, -1):
            loss, stats = forward(self, [self.val_seqs[i] for i in idx])
            loss_sum += loss.item() * stats[0].rows
            for j, st in enumerate(stats):
                rows[j] += st.rows
                hits[j] += st.acc * st.rows
        self.val_acc = [h / max(1, r) for h, r in zip(hits, rows)]
        row = {"step": self.progress.step, "val_loss": round(loss_sum / max(1, rows[0]), 5),
               "val_acc_j": [round(a, 4) for a in self.val_acc], "val_rows": rows[0]}
        with open(self.out / VAL_LOG, "a") as f:
            f.write(json.dumps(row) + "\n")

    # -- saving and resuming ------------------------------------------------------------------
    def save(self) -> None:
        """train_state.pt (atomically) and the head in the published layout."""
        state = {"config": _resume_view(self.cfg), "step": self.progress.step, "epoch": self.progress.epoch,
                 "batch": self.progress.batch, "params": {n: p.detach().cpu() for n, p in self.params.items()},
                 "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "vocab_ids": self.vocab.ids if self.vocab is not None else None, "rng": _rng_state(),
                 "recent": self.recent}
        tmp = self.out / (STATE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.out / STATE)
        heads.save_head(self.out, self.draft, self.vocab, self.head_cfg, self.save_dtype)
        self.evaluate()

    def _restore(self, saved: dict) -> None:
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(saved["params"][name])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.progress = _Progress(saved["step"], saved["epoch"], saved["batch"])
        self.evaluated_at = saved["step"]  # every save is scored (save())
        self.recent = saved["recent"]
        _set_rng_state(saved["rng"])
        logger.info("resuming at step %d (epoch %d, batch %d)", saved["step"], saved["epoch"], saved["batch"])


def forward(run: _Run, seqs: list[Sequence]) -> tuple[torch.Tensor, list[StepStats]]:
    """Teacher, unroll and objective on one batch: (weighted loss, per-TTT-step stats)."""
    batch = collate(seqs, run.device)
    rows = answer_rows(batch.lengths, batch.prompt_lens, batch.ids.shape[1])
    taught = run.teacher(batch.ids, batch.lengths, rows)
    with _autocast(run.device):
        outs = heads.unroll(run.draft, taught.features, batch.ids, run.cfg.ttt_steps)
        return run.objective(outs, taught)


def train_step(run: _Run, seqs: list[Sequence]) -> tuple[float, list[StepStats], float]:
    """One optimizer step on one batch: (weighted loss, per-TTT-step stats, grad norm)."""
    loss, stats = forward(run, seqs)
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(run.params.values(), run.cfg.grad_clip)
    run.optimizer.step()
    run.scheduler.step()
    return loss.item(), stats, float(grad_norm)


def _autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; CPU trains in plain fp32."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _resume_view(cfg: TrainConfig) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k in _RESUME_KEYS}


def _check_same_run(saved: dict, cfg: TrainConfig) -> None:
    now, default = _resume_view(cfg), _resume_view(TrainConfig("", "", Path()))  # keys newer than the run
    then = {k: saved.get(k, default[k]) for k in _RESUME_KEYS}
    diff = [f"{k}: {then[k]!r} then, {now[k]!r} now" for k in _RESUME_KEYS if then[k] != now[k]]
    if diff:
        raise ValueError(f"--resume with different settings ({'; '.join(diff)}): use the original "
                         "settings or another --output")


def _rng_state() -> dict:
    state: dict[str, torch.Tensor | list[torch.Tensor]] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
