"""`--enable-torch-compile`: the compiled forward gives the eager forward's tokens.

On CPU inductor compiles to C++; on a GPU the same tests run the compiled forward inside
the CUDA graphs (their warm-up runs compile it). Greedy output must be token-identical
to the same engine without compiling, plain and speculative (EAGLE-3's verify is a
compiled VERIFY forward that also returns the target's features); the compiled forward
must trace in one piece (attention is a custom op, not a graph break) and must serve
only DECODE and VERIFY batches up to --torch-compile-max-bs.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters

from specserve import Engine
from specserve.core.forward_batch import ForwardMode
from specserve.models.compile import CompiledForward
from tests.unit.eagle_utils import tiny_target
from tests.unit.model_utils import EXACT_ON_GPU, held_out_greedy, tiny_engine

pytestmark = pytest.mark.slow


def test_only_small_decode_and_verify_batches_are_compiled() -> None:
    compiled = CompiledForward(lambda fb: None, max_bs=4)  # torch.compile is lazy: nothing compiles here
    batch = lambda mode, b: SimpleNamespace(mode=mode, batch_size=b)  # noqa: E731
    assert compiled.serves(batch(ForwardMode.DECODE, 4)) and compiled.serves(batch(ForwardMode.VERIFY, 1))
    assert not compiled.serves(batch(ForwardMode.DECODE, 5))
    assert not compiled.serves(batch(ForwardMode.EXTEND, 1))
    assert not compiled.serves(batch(ForwardMode.DRAFT_EXTEND, 1))


@pytest.fixture
def compiled_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many forwards went through a compiled forward; graph breaks are counted afresh."""
    calls = {"n": 0}
    call = CompiledForward.__call__

    def counting(self, fb):
        calls["n"] += 1
        return call(self, fb)

    monkeypatch.setattr(CompiledForward, "__call__", counting)
    counters.clear()
    return calls


def _clean(engine: Engine) -> None:
    assert not engine.scheduler.has_work
    engine.scheduler.kv.flush_cache()
    engine.scheduler.kv.assert_no_leak()


def test_compiled_plain_decoding_is_token_identical(tmp_path, smollm2_dir, compiled_calls) -> None:
    target = tiny_target(tmp_path / "target")
    prompts = [[5 + i, 17, 300 + 7 * i, 42][: 2 + i] for i in range(4)]
    # ragged lengths: the batch of 4 (above the bound, eager) shrinks to 2 and 1 (compiled)
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (6, 12, 20, 28)]
    outs = {}
    for compile_ in (False, True):
        engine = tiny_engine(target, smollm2_dir, enable_torch_compile=compile_, torch_compile_max_bs=2)
        outs[compile_] = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        outs[compile_] += [engine.generate(input_ids=prompts[0], sampling_params=params[3])["output_ids"]]
        _clean(engine)
        engine.shutdown()
    assert outs[True] == outs[False]
    # on CPU every step with 2 or fewer requests left; on a GPU the graphs' warm-ups and captures
    assert compiled_calls["n"] >= (1 if torch.cuda.is_available() else 28 - 12)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compiled_eagle3_verify_is_token_identical(smollm2_engine, compiled_calls) -> None:
    engine = Engine("smollm2-135m", log_level="warning", speculative_algorithm="EAGLE3", speculative_num_steps=3,
                    speculative_eagle_topk=1, speculative_num_draft_tokens=4, speculative_adaptive="off",
                    enable_torch_compile=True, torch_compile_max_bs=1, **EXACT_ON_GPU)
    want, outs = held_out_greedy(engine, smollm2_engine, 32)
    assert [o["output_ids"] for o in outs] == want
    verifies = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    assert verifies > 0 and compiled_calls["n"] >= (1 if torch.cuda.is_available() else verifies)
    assert not counters["graph_break"], dict(counters["graph_break"])
    _clean(engine)
    engine.shutdown()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def test_bench_compile_reports_both_engines(tmp_path, smollm2_dir) -> None:
    import json

    from specserve.bench.compile import main

    target, out = tiny_target(tmp_path / "target"), tmp_path / "compile.jsonl"
    args = ["--model", str(target), "--engine-args", f"tokenizer_path={smollm2_dir}", "--num-prompts", "2",
            "--max-new-tokens", "4", "--torch-compile-max-bs", "1", "--output", str(out)]
    assert main(args) == 0
    row = json.loads(out.read_text())
    assert row["identical_outputs"] == 2 and row["eager_tok_s"] > 0 and row["compiled_tok_s"] > 0
