"""`specserve bench limit`'s runner loop on the CPU: the figures come out and every slot
it took goes back (the benchmark itself needs a GPU: its model is 8B-shaped)."""
from __future__ import annotations

import pytest

from specserve.bench import limit


def test_runner_loop_times_decode_and_verify_and_frees_its_slots(engine_no_leak) -> None:
    sched = engine_no_leak.scheduler
    step_s, kv_mid, ratio, graph_us = limit._decode(sched.runner, sched.kv, prompt_len=8, steps=3)
    assert step_s > 0 and ratio > 0 and 8 < kv_mid < 8 + 1 + 8 + 3
    assert graph_us == (0.0, 0.0) and limit._graph_note(graph_us) == "no graphs"  # no CUDA graphs here
    assert limit._graph_note((5410.0, 6397.0)) == "graphs: 6397 / 5410 us = 1.182x"


def test_a_prompt_past_the_context_is_refused_with_a_clear_line(capsys) -> None:
    """A prompt and steps that do not fit the served model's context stop at the command
    line (they made the benchmark divide by zero tokens after loading an 8B model)."""
    for argv in (["--prompt-len", "4096"], ["--prompt-len", "4000", "--steps", "100"], ["--steps", "0"]):
        with pytest.raises(SystemExit) as stop:
            limit.main(argv)
        assert stop.value.code == 2
        assert "must be at least 1 and add up to at most 4070" in capsys.readouterr().err


def test_every_shape_is_a_config_the_loader_reads() -> None:
    """The random models' shapes: Llama-3.1 8B and 70B, the default model's and the
    catalogue's Qwen2.5 1.5B (q/k/v bias, untied head), as the loader reads them."""
    from specserve.models.llama import LlamaConfig

    layers = {name: LlamaConfig.from_hf(shape).num_layers for name, shape in limit.SHAPES.items()}
    assert layers == {"8b": 32, "70b": 80, "smollm2": 30, "qwen2.5-1.5b": 28}
    qwen = LlamaConfig.from_hf(limit.SHAPES["qwen2.5-1.5b"])
    assert (qwen.hidden_size, qwen.num_kv_heads, qwen.head_dim, qwen.vocab_size) == (1536, 2, 128, 151936)
    assert set(limit.NAMES) == set(limit.SHAPES)
