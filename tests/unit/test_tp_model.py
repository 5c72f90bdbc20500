"""Tensor parallelism in the model: what each rank loads, and that the ranks together
compute what one process computes.

The sharding tests set a rank's place (core/parallel.py) without a process group: loading
runs no collective. The logits tests run real gloo ranks (bench/ranks.py) over
tiny Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k norms) configs, one whose KV heads are fewer
than the ranks (replicated), and SmolLM2, whose 3 KV groups split 1 + 2 over two ranks.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.bench.ranks import run_on_ranks
from specserve.core import parallel
from specserve.core.forward_batch import ForwardMode
from specserve.models.layers import Linear
from specserve.models.llama import LlamaConfig, LlamaForCausalLM
from specserve.models.loader import iter_safetensors, load_model, read_hf_config
from tests.unit.model_utils import BareRunner, save_tiny_hf

CONFIGS = {  # name -> (kind, overrides)
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "one-kv-head": ("llama", {"num_key_value_heads": 1}),
    "three-groups": ("llama", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}),
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    return {name: save_tiny_hf(kind, root / name, **over) for name, (kind, over) in CONFIGS.items()}


@pytest.fixture(autouse=True)
def _one_rank():
    yield
    parallel.set_tp(parallel.TPGroup())


def _load_as(path: Path, tp: int, rank: int) -> LlamaForCausalLM:
    parallel.set_tp(parallel.TPGroup(tp, rank))
    cfg = LlamaConfig.from_hf(read_hf_config(path))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    model.load_weights(iter_safetensors(path))
    return model


@pytest.mark.parametrize("heads, kv, tp, want", [
    (4, 2, 2, [(0, 2, 0, 1), (2, 2, 1, 1)]),
    (9, 3, 2, [(0, 3, 0, 1), (3, 6, 1, 2)]),  # SmolLM2: whole groups, as even as they go
    (4, 1, 2, [(0, 2, 0, 1), (2, 2, 0, 1)]),  # one KV head, replicated; its queries split
    (8, 2, 4, [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]),
    (4, 4, 1, [(0, 4, 0, 4)]),
])
def test_head_shards(heads, kv, tp, want):
    got = []
    for r in range(tp):
        parallel.set_tp(parallel.TPGroup(tp, r))
        got.append(parallel.head_shard(heads, kv))
        assert parallel.kv_heads_per_rank(kv) == got[-1][3]
    assert got == want


def test_heads_that_do_not_fit_are_refused():
    parallel.set_tp(parallel.TPGroup(4, 0))
    with pytest.raises(ValueError, match="does not fit 6 attention heads in 2 KV groups"):
        parallel.head_shard(6, 2)  # KV heads replicated on 2 ranks each, 3 query heads per group
    with pytest.raises(ValueError, match="vocabulary size .* not divisible by the tensor-parallel size 4"):
        parallel.vocab_per_rank(49150)


@pytest.mark.parametrize("name, tp", [("llama", 2), ("qwen2", 2), ("qwen3", 2), ("one-kv-head", 2),
                                      ("three-groups", 2), ("llama", 4)])
def test_gathered_shards_equal_the_full_tensors(tiny_dirs, name, tp):
    full = dict(_load_as(tiny_dirs[name], 1, 0).named_parameters())
    cfg = LlamaConfig.from_hf(read_hf_config(tiny_dirs[name]))
    ranks = [dict(_load_as(tiny_dirs[name], tp, r).named_parameters()) for r in range(tp)]
    d = cfg.head_dim
    for key, whole in full.items():
        parts = [shards[key] for shards in ranks]
        if "qkv_proj" in key:
            q = cfg.num_heads * d
            kv = cfg.num_kv_heads * d
            queries = []
            for r, part in enumerate(parts):
                parallel.set_tp(parallel.TPGroup(tp, r))
                _, qn, kv0, kvn = parallel.head_shard(cfg.num_heads, cfg.num_kv_heads)
                queries.append(part[:qn * d])
                k_rows = slice(q + kv0 * d, q + (kv0 + kvn) * d)
                v_rows = slice(q + kv + kv0 * d, q + kv + (kv0 + kvn) * d)
                assert torch.equal(part[qn * d:], torch.cat([whole[k_rows], whole[v_rows]]))
            assert torch.equal(torch.cat(queries), whole[:q])
        elif "gate_up_proj" in key:
            halves = [p.chunk(2) for p in parts]
            assert torch.equal(torch.cat([g for g, _ in halves] + [u for _, u in halves]), whole)
        elif key.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), whole)
        elif key.endswith(("embed_tokens.weight", "lm_head.weight")):
            assert torch.equal(torch.cat(parts), whole)
        else:  # norms: replicated
            assert all(torch.equal(p, whole) for p in parts), key


def _logits(path: str, quantization: str | None = None) -> torch.Tensor:
    """Prefill two prompts, decode one token each, verify a 3-node tree: every logit row."""
    return _rows(load_model(Path(path), torch.float32, torch.device("cpu"), quantization))


def _block_logits(path: str) -> torch.Tensor:
    """`_logits` of a GGUF model served in its blocks, every projection and the head."""
    model = load_model(Path(path), torch.float32, torch.device("cpu"))
    held = [m.quantized for m in model.modules() if isinstance(m, Linear)]
    assert model.head_blocks is not None and all(qw is not None and qw.method in ("q4", "q8") for qw in held)
    return _rows(model)


def _rows(model: LlamaForCausalLM) -> torch.Tensor:
    run = BareRunner(model)
    rows = [run.forward([0, 1], [0, 0], [[5, 9, 2, 7], [3, 3, 8]])]
    rows.append(run.forward([0, 1], [4, 3], [[11], [12]], mode=ForwardMode.DECODE))
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    rows.append(run.forward([0], [5], [[4, 6, 13]], positions=[[5, 6, 6]], masks=[mask], mode=ForwardMode.VERIFY))
    return torch.cat(rows)


@pytest.mark.parametrize("name, tp", [("llama", 2), ("qwen2", 2), ("qwen3", 2), ("one-kv-head", 2),
                                      ("three-groups", 2), ("llama", 4)])
def test_ranks_compute_the_single_process_logits(tiny_dirs, name, tp):
    want = _logits(str(tiny_dirs[name]))
    got = run_on_ranks(_logits, tp, str(tiny_dirs[name]), on_gpu=False)
    for r in range(tp):  # every rank holds the whole gathered logits
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["quantized at load", "channel", "block"])
def test_fp8_shards_hold_the_single_process_values(tiny_dirs, tmp_path, scheme):
    """fp8 scales are cut like their weights (a float weight is quantized whole, then cut):
    the ranks compute the single process's fp8 model."""
    from tests.unit.test_fp8 import _fp8_checkpoint

    path, flag = tiny_dirs["llama"], "fp8"
    if scheme != "quantized at load":
        _fp8_checkpoint(path, tmp_path / "fp8", scheme)
        path, flag = tmp_path / "fp8", None
    want = _logits(str(path), flag)
    got = run_on_ranks(_logits, 2, str(path), flag, on_gpu=False)
    for r in range(2):
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["awq", "gptq"])
@pytest.mark.parametrize("kernels", ["dequantized", "q4"])
def test_int4_shards_hold_the_single_process_values(tiny_dirs, tmp_path, method, kernels, monkeypatch):
    """An AWQ/GPTQ layer is cut like a float one: rows, or a row-parallel layer's byte
    columns with its scales' and zero points' groups. Both sides hold the dequantized
    values, or both the CPU's q4 blocks of them (models/layers.py cpu_layout), whose int16
    rounding of each product's inputs turns the all-reduce's last bits into rounding steps."""
    from specserve.kernels import cpu_quant
    from tests.unit.test_int4_model import write_int4

    if kernels == "q4" and not cpu_quant.available():
        pytest.skip("no C compiler: int4 weights run dequantized")
    path = tmp_path / method
    write_int4(tiny_dirs["llama"], path, method, group=32)
    logits = _logits
    if kernels == "dequantized":
        monkeypatch.setattr(cpu_quant, "available", lambda: False)
        logits = _dequantized_logits
    want = _logits(str(path))
    got = run_on_ranks(logits, 2, str(path), on_gpu=False)
    tol = 1e-5 if kernels == "dequantized" else 2e-2
    for r in range(2):
        torch.testing.assert_close(got[r], want, rtol=tol, atol=tol)
        assert torch.equal(got[r].argmax(-1), want.argmax(-1))


def _dequantized_logits(path: str) -> torch.Tensor:
    """`_logits` in a rank that has no CPU quantized kernels (int4 layers dequantized)."""
    from specserve.kernels import cpu_quant

    cpu_quant.available = lambda: False  # this rank process's own module
    return _logits(path)


def test_int4_groups_that_a_rank_would_split_are_refused(tiny_dirs, tmp_path):
    """Groups of 48 columns against o_proj's 32 a rank at TP 2 (a whole-row group would be
    cut fine: its one scale and zero point serve every column)."""
    from tests.unit.test_int4_model import write_int4

    path = tmp_path / "awq48"
    write_int4(tiny_dirs["llama"], path, "awq", group=48)
    parallel.set_tp(parallel.TPGroup(2, 1))
    with pytest.raises(ValueError, match="split a quantization group of 48"):
        load_model(path, torch.float32, torch.device("cpu"))


def test_smollm2_at_tp2_computes_its_logits(smollm2_dir):
    # float weights at both sizes (the blocks: the next test)
    want = _logits(str(smollm2_dir), "none")
    got = run_on_ranks(_logits, 2, str(smollm2_dir), "none", on_gpu=False)
    # 30 layers whose partial sums add in another order: logits of magnitude ~20 agree to ~1e-4
    torch.testing.assert_close(got[0], want, rtol=1e-3, atol=5e-3)
    assert torch.equal(got[0].argmax(-1), want.argmax(-1))


def test_smollm2_in_its_gguf_blocks_at_tp2_computes_its_logits(smollm2_dir):
    """Each rank keeps its slice of the GGUF's q4 and q8 blocks, cut as the float weights
    are (q/k/v rows by head, gate and up apart, o_proj and down_proj by whole blocks of
    columns, the head by vocabulary): the ranks compute what one process computes from the
    whole blocks (there in one C call a forward, here layer by layer: the C stack has no
    all-reduce)."""
    from specserve.kernels import cpu_quant

    if not cpu_quant.available():
        pytest.skip("no C compiler: GGUF weights run dequantized")
    want = _block_logits(str(smollm2_dir))
    got = run_on_ranks(_block_logits, 2, str(smollm2_dir), on_gpu=False)
    # Each product rounds its inputs to int16, which turns the last-bit differences of the
    # all-reduce's order into rounding steps: logits of magnitude ~30 agree to ~0.1 (one
    # process's C stack and its layer-by-layer path differ by ~0.04 already)
    torch.testing.assert_close(got[0], want, rtol=1e-2, atol=0.2)
    assert torch.equal(got[0].argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_ranks_gguf_blocks_hold_its_float_shards_values(smollm2_dir, rank):
    """The blocks a rank keeps hold exactly the values of the float conversion's shard it
    would load (the float conversion is the blocks' values: test_gguf_serve.py)."""
    from specserve.models import gguf_serve

    parallel.set_tp(parallel.TPGroup(2, rank))
    floats = load_model(smollm2_dir, torch.float32, torch.device("cpu"), "none")
    with torch.device("meta"):
        meta = LlamaForCausalLM(floats.config)
    blocks = gguf_serve.plan(meta, smollm2_dir)
    assert len(blocks.layers) == 4 * floats.config.num_layers and blocks.head is not None
    for name, qw in blocks.layers.items():
        assert torch.equal(qw.dequantize(torch.float32), floats.get_submodule(name).out_in_weight), name
    assert torch.equal(blocks.head.dequantize(torch.float32), floats.lm_head.weight)
