"""`specserve bench mtbench`: SGLang's MT-bench table, plain against EAGLE-2 / EAGLE-3 / NGRAM /
STANDALONE.

The 80 MT-bench questions (first turn by default; `--turns 2` also runs the second turn, whose
prompt holds each method's own first answer), or HumanEval's 164 stubs (`--questions humaneval`,
one turn; bench/prompts.py), chat-templated, greedy (or with `--temperature`
sampled, question i seeded i, which speculative sampling reproduces token for token), at every
batch size of `--batch-sizes`. Methods: our plain engine, then EAGLE-2 (`--eagle-draft`), EAGLE-3
(`--eagle3-draft`, repeatable: one row per head, to compare heads in one run), NGRAM (`--ngram`)
and STANDALONE (`--standalone-draft`, a draft model; with `--standalone-token-map` also a row with
that FR-Spec map) when asked for, then Hugging Face transformers
`generate` on the same prompt ids (unless `--no-hf`). One method at a time holds the device:
each engine is created, warmed up (reversed prompts, as `spec_compare.warm_up`), timed and
released before the next, and a fresh one is built for every batch size so NGRAM never learns
the answers of an earlier run. `--rounds R` times each of our engines R times on the same
prompts and reports its middle round (transformers runs once).

Every row reports tokens/s, the accept length (from `meta_info.spec_verify_ct`), the speedup
over our plain engine at the same batch size, how many questions got token-identical
answers to plain at that batch size, and to plain at the first batch size ("same as bs1":
with --enable-deterministic-inference, a request's answer does not depend on its batch).
Rows print as an aligned table (method | bs | tok/s | accept len | speedup | identical |
same as bs1) and go to `--output` as JSON lines; one summary line follows, then a PNG bar chart
of tokens/s per method and batch size (`--plot`, skipped with a note without matplotlib).
"""
from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from specserve.args import positive_int
from specserve.bench.prompts import QUESTION_SETS
from specserve.bench.prompts import questions as question_set
from specserve.bench.report import report
from specserve.bench.spec_compare import WARM_TOKENS, _spec_kwargs, timed_run
from specserve.bench.spec_compare import engine_kwargs as pairs
from specserve.spec import registry

if TYPE_CHECKING:
    from specserve import Engine
    from specserve.tokenizer.tokenizer import Tokenizer

PLAIN, HF = "plain", "HF transformers"
# prompts -> (seconds, output ids per prompt, (drafted verifies, accepted drafts, steps run
# without drafts) summed over prompts)
Generate = Callable[[list[list[int]]], tuple[float, list[list[int]], tuple[int, int, int]]]


class CausalLM(Protocol):
    """A Hugging Face transformers causal LM, as the HF rows drive it: its parameters (for
    the device) and GenerationMixin's `generate`, which returns the id tensor (no
    return_dict_in_generate)."""

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...

    def generate(self, *args: Any, **kwargs: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class Method:
    """One row family of the table: our engine (plain or speculative) or transformers."""

    label: str
    algorithm: str | None = None  # --speculative-algorithm; None: no speculation
    draft: str | None = None  # --speculative-draft-model-path (EAGLE, EAGLE3)
    hf: bool = False
    token_map: str | None = None  # --speculative-token-map (FR-Spec): the row's own, beside --spec-args


@dataclass(frozen=True)
class Answers:
    """One method at one batch size: every question's answers turn by turn, and their cost."""

    seconds: float
    ids: list[list[list[int]]]  # [question][turn] -> output token ids
    verifies: int  # verifies that carried drafts
    accepted: int = 0  # drafts they accepted
    plain_steps: int = 0  # steps the governor ran without drafts (a request's each)

    @property
    def tokens(self) -> int:
        return sum(len(turn) for q in self.ids for turn in q)

    @property
    def requests(self) -> int:
        return sum(len(q) for q in self.ids)


@dataclass(frozen=True)
class Runtime:
    """Where our plain engine ran: transformers loads on the same device with the same dtype."""

    device: torch.device
    dtype: torch.dtype


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench mtbench", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokenizer-path", default=None, help="tokenizer of another model source (as the server flag)")
    p.add_argument("--eagle-draft", default=None, help="EAGLE-2 draft head: adds the EAGLE-2 rows")
    p.add_argument("--eagle3-draft", action="append", default=None,
                   help="EAGLE-3 draft head: adds the EAGLE-3 rows; repeat it to compare heads in one run "
                        "(rows 'EAGLE-3 (<head directory name>)')")
    p.add_argument("--ngram", action="store_true", help="add the NGRAM rows")
    p.add_argument("--standalone-draft", default=None,
                   help="a draft model with the target's tokenizer (path or catalogue name): adds the STANDALONE rows")
    p.add_argument("--standalone-token-map", default=None, help="an FR-Spec map (specserve token-map): adds "
                   "STANDALONE (FR-Spec) rows beside the STANDALONE ones")
    p.add_argument("--spec-args", default="",
                   help="extra flags of every speculative engine, e.g. 'speculative_num_steps=3,"
                        "speculative_eagle_topk=1,speculative_num_draft_tokens=4'")
    p.add_argument("--engine-args", default="",
                   help="flags of every specserve engine, e.g. 'tp_size=2' or 'max_total_tokens=65536'")
    p.add_argument("--no-hf", action="store_true", help="skip Hugging Face transformers generate")
    p.add_argument("--questions", default="mtbench", choices=QUESTION_SETS,
                   help="the question set: MT-bench's 80 questions, or HumanEval's 164 function stubs "
                        "(one turn each, asked as a chat turn: bench/prompts.py)")
    p.add_argument("--turns", type=int, default=1, choices=(1, 2))
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--num-questions", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy; above 0: seeded sampling (question i seeded i, as in every method)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling's top-p (with --temperature above 0)")
    p.add_argument("--top-k", type=int, default=0, help="sampling's top-k, 0: none (with --temperature above 0)")
    p.add_argument("--min-p", type=float, default=0.0, help="sampling's min-p (with --temperature above 0)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV slots per engine (default: the engine's)")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="time each of our engines this many times on the same prompts and report its middle "
                        "round (plain decoding at batch 1 is bound by the host, whose speed drifts)")
    p.add_argument("--output", default="bench_mtbench.jsonl")
    p.add_argument("--plot", default="bench_mtbench.png")
    return p


# ---- prompts ---------------------------------------------------------------------------------

def conversation(turns: list[str], answers: list[str]) -> list[dict]:
    """Chat messages for the next turn: every earlier question with its answer, then the next one."""
    messages = []
    for question, answer in zip(turns, answers):
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": turns[len(answers)]}]


def turn_prompts(tok: Tokenizer, questions: list[list[str]], answers: list[list[list[int]]],
                 turn: int) -> list[list[int]]:
    """Prompt ids of turn `turn` (0-based) of every question, holding the model's own earlier answers."""
    return [tok.encode_chat(conversation(q[:turn + 1], [tok.decode(a) for a in ans[:turn]]))
            for q, ans in zip(questions, answers)]


def run_turns(generate: Generate, tok: Tokenizer, questions: list[list[str]], turns: int) -> Answers:
    """Every question turn by turn; turn t+1 is built from turn t's answers, then generated."""
    ids: list[list[list[int]]] = [[] for _ in questions]
    seconds, verifies, accepted, plain_steps = 0.0, 0, 0, 0
    for turn in range(turns):
        s, outs, (v, a, p) = generate(turn_prompts(tok, questions, ids, turn))
        seconds, verifies, accepted, plain_steps = seconds + s, verifies + v, accepted + a, plain_steps + p
        for answers, out in zip(ids, outs):
            answers.append(list(out))
    return Answers(seconds, ids, verifies, accepted, plain_steps)


# ---- methods ---------------------------------------------------------------------------------

def methods_from_args(args: argparse.Namespace) -> list[Method]:
    """plain first (every speedup is relative to it), then the speculative rows asked for, then HF."""
    methods = [Method(PLAIN)]
    if args.eagle_draft is not None:
        methods.append(Method("EAGLE-2", "EAGLE", args.eagle_draft))
    methods += [Method(label, "EAGLE3", draft) for label, draft in eagle3_labels(args.eagle3_draft or [])]
    if args.ngram:
        methods.append(Method("NGRAM", "NGRAM"))
    if args.standalone_draft is not None:
        methods.append(Method("STANDALONE", "STANDALONE", args.standalone_draft))
        if (fr_spec := args.standalone_token_map) is not None:
            methods.append(Method("STANDALONE (FR-Spec)", "STANDALONE", args.standalone_draft, token_map=fr_spec))
    elif args.standalone_token_map is not None:
        raise ValueError("--standalone-token-map needs --standalone-draft")
    if not args.no_hf:
        methods.append(Method(HF, hf=True))
    return methods


def eagle3_labels(drafts: list[str]) -> list[tuple[str, str]]:
    """(row label, head) per EAGLE-3 head: "EAGLE-3" for one head, else "EAGLE-3 (<name>)"
    by directory name, with the position added where two names are equal."""
    if len(drafts) == 1:
        return [("EAGLE-3", drafts[0])]
    names = [Path(d).name or d for d in drafts]
    return [(f"EAGLE-3 ({n})" if names.count(n) == 1 else f"EAGLE-3 ({n} #{i + 1})", d)
            for i, (n, d) in enumerate(zip(names, drafts))]


def engine_kwargs(args: argparse.Namespace, method: Method) -> dict[str, Any]:
    """Engine flags of one method; an EAGLE method without a draft path is an error, not a skipped row."""
    kw: dict[str, Any] = dict(device=args.device, dtype=args.dtype, log_level="warning",
                              tokenizer_path=args.tokenizer_path, max_total_tokens=args.max_total_tokens,
                              max_running_requests=max(batch_sizes(args)))
    kw |= pairs(args.engine_args)
    if method.algorithm is None:
        return kw
    if registry.get(method.algorithm).draft_model != "none" and not method.draft:
        raise ValueError(f"{method.label}: no draft model path given ({method.draft!r})")
    kw |= {"speculative_token_map": method.token_map} if method.token_map else {}
    return kw | _spec_kwargs(SimpleNamespace(algorithm=method.algorithm, spec_args=args.spec_args), method.draft)


def start_engine(args: argparse.Namespace, method: Method) -> Engine:
    from specserve import Engine

    try:
        return Engine(args.model, **engine_kwargs(args, method))
    except Exception as e:  # fail loudly, with the row that could not start
        raise RuntimeError(f"mtbench: the {method.label} engine failed to start: {e}") from e


def release(engine: Engine) -> None:
    """Stop an engine; the caller drops its last reference, then calls free_device_memory()."""
    shutdown = getattr(engine, "shutdown", None)
    if callable(shutdown):
        shutdown()


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def filters(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling filters asked for, as sampling params (none where left at their defaults)."""
    asked = {"top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p}
    return {k: v for k, v in asked.items() if v != {"top_p": 1.0, "top_k": 0, "min_p": 0.0}[k]}


def ours(engine: Engine, max_new: int, bs: int, temperature: float = 0.0, limits: dict | None = None) -> Generate:
    """Our engine: warm-up on reversed prompts, then timed batches of bs (spec_compare.timed_run)."""
    def generate(prompts: list[list[int]]) -> tuple[float, list[list[int]], tuple[int, int, int]]:
        seconds, outs = timed_run(engine, prompts, max_new, bs, temperature, limits)
        meta = [o["meta_info"] for o in outs]
        return seconds, [o["output_ids"] for o in outs], tuple(
            sum(m.get(key, 0) for m in meta) for key in ("spec_verify_ct", "spec_accept_token_num", "spec_plain_ct"))
    return generate


def until_eos(ids: list[int], eos: set[int]) -> list[int]:
    """Ids up to and including the first EOS (transformers pads finished rows of a batch)."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i + 1]
    return ids


def hf_batches(model: CausalLM, prompts: list[list[int]], max_new: int, bs: int,
               eos: list[int], temperature: float = 0.0, limits: dict | None = None) -> list[list[int]]:
    """transformers generate (greedy, or sampling at `temperature` with `limits`: top_p,
    top_k, min_p) in batches of bs, left-padded, outputs cut after EOS."""
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) | (limits or {}) \
        if temperature > 0 else dict(do_sample=False)
    dev, pad, outs = next(model.parameters()).device, eos[0], []
    for i in range(0, len(prompts), bs):
        batch = prompts[i:i + bs]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=dev)
        out = model.generate(input_ids=ids, attention_mask=mask, **sampling, max_new_tokens=max_new,
                             eos_token_id=eos, pad_token_id=pad)
        outs += [until_eos(row, set(eos)) for row in out[:, width:].tolist()]
    return outs


def hf(model: CausalLM, max_new: int, bs: int, eos: list[int], temperature: float = 0.0,
       limits: dict | None = None) -> Generate:
    """transformers, warmed up like our engines (every prompt reversed, WARM_TOKENS tokens at the
    timed temperature, same batching)."""
    def generate(prompts: list[list[int]]) -> tuple[float, list[list[int]], tuple[int, int, int]]:
        with torch.inference_mode():
            hf_batches(model, [p[::-1] for p in prompts], WARM_TOKENS, bs, eos, temperature, limits)
            start = time.perf_counter()
            outs = hf_batches(model, prompts, max_new, bs, eos, temperature, limits)
        return time.perf_counter() - start, outs, (0, 0, 0)
    return generate


def load_hf(model_dir: Path, runtime: Runtime) -> CausalLM:
    import transformers
    from packaging.version import Version

    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **{key: runtime.dtype})
    # Moved and switched to eval in place (nn.Module's `to` and `eval` return the module itself),
    # through the nn.Module view: transformers' functools.wraps on PreTrainedModel.to hides its
    # signature from type checkers.
    module: torch.nn.Module = model
    module.to(runtime.device).eval()
    return model


def _measure_ours(args: argparse.Namespace, method: Method, bs: int, tok: Tokenizer,
                  questions: list[list[str]]) -> tuple[Answers, Runtime]:
    engine = start_engine(args, method)
    try:
        info = engine.server_info()
        runtime = Runtime(torch.device(info["device"]), getattr(torch, info["dtype"].removeprefix("torch.")))
        generate = ours(engine, args.max_new_tokens, bs, args.temperature, filters(args))
        rounds = [run_turns(generate, tok, questions, args.turns) for _ in range(args.rounds)]
        return middle_round(rounds), runtime
    finally:
        release(engine)


def middle_round(rounds: list[Answers]) -> Answers:
    """The round of median tokens/s (the slower middle one of an even count). Greedy and
    seeded runs give every round the same tokens, so only the time differs."""
    return sorted(rounds, key=lambda a: a.tokens / a.seconds, reverse=True)[len(rounds) // 2]


def _measure_hf(args: argparse.Namespace, bs: int, tok: Tokenizer, questions: list[list[str]],
                runtime: Runtime) -> Answers:
    from specserve.models.source import resolve_model_dir

    model = load_hf(resolve_model_dir(args.model), runtime)
    return run_turns(hf(model, args.max_new_tokens, bs, sorted(tok.eos_token_ids), args.temperature, filters(args)),
                     tok, questions, args.turns)


def measure(args: argparse.Namespace, method: Method, bs: int, tok: Tokenizer, questions: list[list[str]],
            runtime: Runtime | None) -> tuple[Answers, Runtime]:
    """One method at one batch size; its model is gone from the device when this returns."""
    if method.hf:
        if runtime is None:
            raise ValueError("transformers runs after our plain engine: its device and dtype are not known yet")
        result = _measure_hf(args, bs, tok, questions, runtime), runtime
    else:
        result = _measure_ours(args, method, bs, tok, questions)
    free_device_memory()
    return result


# ---- report ----------------------------------------------------------------------------------

def batch_sizes(args: argparse.Namespace) -> list[int]:
    return [int(b) for b in args.batch_sizes.split(",")]


def accept_length(method: Method, answers: Answers) -> float | None:
    """Tokens per verify that carried drafts (accepted drafts + 1; steps the governor ran
    plainly do not count); 1 without speculation."""
    if method.hf:
        return None
    if method.algorithm is None or not answers.verifies:
        return 1.0
    return (answers.accepted + answers.verifies) / answers.verifies


def identical(a: Answers, b: Answers) -> int:
    """Questions whose answers are token-identical in every turn."""
    return sum(x == y for x, y in zip(a.ids, b.ids))


def make_row(args: argparse.Namespace, method: Method, bs: int, answers: Answers, plain: Answers,
             runtime: Runtime, first_plain: Answers | None = None) -> dict:
    """One JSON row; `first_plain`: plain at the first batch size, which `identical_to_first_bs`
    counts against (a request's output should not depend on its batch)."""
    tok_s = answers.tokens / answers.seconds
    return {"bench": "mtbench", "questions": args.questions, "model": args.model, "method": method.label,
            "algorithm": method.algorithm,
            "draft": method.draft, "batch_size": bs, "device": str(runtime.device),
            "dtype": str(runtime.dtype).removeprefix("torch."), "num_questions": len(answers.ids),
            "turns": args.turns, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "filters": filters(args) if args.temperature > 0 else {},
            "tokens": answers.tokens,
            "seconds": answers.seconds, "tok_s": tok_s, "accept_length": accept_length(method, answers),
            "speedup": tok_s / (plain.tokens / plain.seconds), "identical_outputs": identical(answers, plain),
            "identical_to_first_bs": identical(answers, first_plain or plain),
            "plain_steps": answers.plain_steps,
            "spec_args": args.spec_args if method.algorithm else "", "rounds": 1 if method.hf else args.rounds}


COLUMNS = (("bs", 4), ("tok/s", 10), ("accept len", 11), ("speedup", 8), ("identical", 10), ("same as bs1", 11))


def table_header(width: int) -> str:
    return " | ".join([f"{'method':<{width}}"] + [f"{name:>{w}}" for name, w in COLUMNS])


def table_line(row: dict, width: int) -> str:
    accept = "-" if row["accept_length"] is None else f"{row['accept_length']:.2f}"
    cells = (row["batch_size"], f"{row['tok_s']:.1f}", accept, f"{row['speedup']:.2f}x",
             f"{row['identical_outputs']}/{row['num_questions']}",
             f"{row['identical_to_first_bs']}/{row['num_questions']}")
    return " | ".join([f"{row['method']:<{width}}"] + [f"{c:>{w}}" for c, (_, w) in zip(cells, COLUMNS)])


def summary(rows: list[dict]) -> str:
    """One line: the fastest method at each batch size and the identical-output total of speculation."""
    first = rows[0]
    parts = []
    for bs in dict.fromkeys(r["batch_size"] for r in rows):
        best = max((r for r in rows if r["batch_size"] == bs), key=lambda r: r["tok_s"])
        parts.append(f"bs={bs} {best['method']} {best['tok_s']:.1f} tok/s ({best['speedup']:.2f}x)")
    spec = [r for r in rows if r["algorithm"]]
    same = (f"; speculative outputs identical to plain: {sum(r['identical_outputs'] for r in spec)}/"
            f"{sum(r['num_questions'] for r in spec)}") if spec else ""
    return (f"{first['questions']} {first['model']}"
            f" ({first['device']}, {first['dtype']}, {first['num_questions']} questions x "
            f"{first['turns']} turn(s), {_decoding(first)}, max {first['max_new_tokens']} new tokens): fastest "
            + ", ".join(parts) + same)


def _decoding(row: dict) -> str:
    t = row.get("temperature", 0.0)
    limits = "".join(f", {k.replace('_', '-')} {v:g}" for k, v in row.get("filters", {}).items())
    return f"temperature {t:g}{limits}, seeded" if t else "greedy"


def plot(rows: list[dict], path: str) -> None:
    """Grouped bars: tokens/s of every method at every batch size."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    sizes = list(dict.fromkeys(r["batch_size"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    tok_s = {(r["method"], r["batch_size"]): r["tok_s"] for r in rows}
    bar = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(sizes) * len(methods) ** 0.5, 4))
    for i, m in enumerate(methods):
        xs = [k + (i - (len(methods) - 1) / 2) * bar for k in range(len(sizes))]
        ax.bar(xs, [tok_s.get((m, bs), 0.0) for bs in sizes], bar, label=m)
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels([f"bs={bs}" for bs in sizes])
    first = rows[0]
    title = f"{first['questions']}, {Path(first['model']).name} ({first['device']})"
    ax.set(ylabel="tokens/s", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


# ---- main ------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> list[dict]:
    """Every method at every batch size, one model on the device at a time; returns the JSON rows."""
    from specserve.models.source import resolve_model_dir
    from specserve.tokenizer.tokenizer import load_tokenizer

    methods = methods_from_args(args)
    for m in methods:
        engine_kwargs(args, m)  # a bad configuration fails before anything is timed
    tok = load_tokenizer(resolve_model_dir(args.tokenizer_path or args.model))
    questions = question_set(args.questions, args.num_questions)
    if args.turns > max(map(len, questions)):
        raise ValueError(f"--turns {args.turns}: the {args.questions} questions have one turn each")
    width = max(len("method"), *(len(m.label) for m in methods))
    print(table_header(width), flush=True)
    rows: list[dict] = []
    first_plain: Answers | None = None
    for bs in batch_sizes(args):
        plain, runtime = None, None
        for method in methods:
            answers, runtime = measure(args, method, bs, tok, questions, runtime)
            if plain is None:  # methods[0]: every speedup and identical count is against it
                plain = answers
                first_plain = first_plain or answers
            row = make_row(args, method, bs, answers, plain, runtime, first_plain)
            report(table_line(row, width), row, args.output)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    rows = run(args)
    print(summary(rows), flush=True)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
