"""AWQ and GPTQ checkpoints served: a model's layers land on the checkpoint's values, and
speculative decoding over a 4-bit target is lossless with respect to that target (greedy
token-identical). On the CPU the 4-bit layers are held as q4 blocks for the CPU's kernels
(models/layers.py cpu_layout); tests/unit/test_int4.py and test_blocks_kernel.py prove the
GPU kernels equal the dequantized product."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import Engine
from specserve.core import quant
from specserve.core.quant import QuantWeight
from specserve.kernels import cpu_quant
from specserve.models import quantization
from specserve.models.layers import Linear
from specserve.models.loader import load_model
from specserve.models.quant_int4 import dequantize_int4, pack_awq, pack_gptq, quantize_int4
from tests.unit.model_utils import EXACT_ON_GPU, save_tiny_hf
from tests.unit.test_fp8 import _weights
from tests.unit.test_spec_engine import GREEDY, PROMPTS, _check, _clean, _ids

SHIPPED_HEAD = Path(__file__).parents[2] / "specserve" / "heads" / "smollm2-135m-eagle3"


def write_int4(src: Path, dst: Path, method: str, group: int) -> dict[str, QuantWeight]:
    """`src`'s float checkpoint as an AWQ (or GPTQ v1, symmetric) one at `dst`, as those tools
    save it; returns the int4 weight of every linear layer by its HF weight name."""
    tensors, out, expected = load_file(str(src / "model.safetensors")), {}, {}
    for name, t in tensors.items():
        if not (name.endswith("proj.weight") and t.dim() == 2):
            out[name] = t
            continue
        qw = quantize_int4(t, group, sym=method == "gptq", scale_dtype=torch.float16)
        parts = pack_awq(qw) if method == "awq" else pack_gptq(qw)
        out |= {f"{name.removesuffix('.weight')}.{part}": v for part, v in parts.items()}
        expected[name] = qw
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = ({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                   "version": "gemm"} if method == "awq" else
                                  {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True,
                                   "desc_act": False})
    (dst / "config.json").write_text(json.dumps(cfg))
    for extra in src.iterdir():  # tokenizer and generation files
        if extra.suffix != ".safetensors" and extra.name != "config.json" and extra.is_file():
            (dst / extra.name).write_bytes(extra.read_bytes())
    return expected


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_int4_checkpoints_load_to_their_values(tmp_path, method):
    src = save_tiny_hf("llama", tmp_path / "float")
    expected = write_int4(src, tmp_path / method, method, group=32)
    model = load_model(tmp_path / method, torch.float32, torch.device("cpu"))
    assert model.weight_quant is not None and model.weight_quant.method == method
    info = quantization.info(model)
    assert info["method"] == method and info["from_checkpoint"]
    layers = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    if cpu_quant.available():  # the CPU holds them as q4 blocks for its kernels (models/layers.py cpu_layout)
        assert all(m.method == quant.Q4 for m in layers)
    for m in layers:
        m.dequantize_storage(torch.float32)
    got = _weights(model)
    for name, qw in expected.items():  # the blocks' q * scale + offset: (q - zero) * scale up to fp32 rounding
        torch.testing.assert_close(got[name], dequantize_int4(qw), atol=1e-7, rtol=2**-22, msg=name)


def test_int4_flag_needs_such_a_checkpoint(tmp_path):
    src = save_tiny_hf("llama", tmp_path / "float")
    with pytest.raises(ValueError, match="needs a checkpoint quantized by AWQ"):
        load_model(src, torch.float32, torch.device("cpu"), quantization="awq")
    write_int4(src, tmp_path / "awq", "awq", group=32)
    with pytest.raises(ValueError, match="stored in awq; --quantization fp8 does not apply"):
        load_model(tmp_path / "awq", torch.float32, torch.device("cpu"), quantization="fp8")


def test_int4_layer_missing_a_part_is_named(tmp_path):
    src = save_tiny_hf("llama", tmp_path / "float")
    write_int4(src, tmp_path / "awq", "awq", group=32)
    tensors = load_file(str(tmp_path / "awq" / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.qzeros"]
    save_file(tensors, str(tmp_path / "awq" / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj"):
        load_model(tmp_path / "awq", torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def smollm2_awq(smollm2_dir, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("awq") / "smollm2-awq"
    write_int4(Path(smollm2_dir), dst, "awq", group=64)
    return dst


@pytest.fixture(scope="module")
def awq_reference(smollm2_awq) -> list[list[int]]:
    """Plain greedy outputs of the 4-bit SmolLM2, computed once."""
    plain = Engine(str(smollm2_awq), log_level="warning", **EXACT_ON_GPU)
    reference = [o["output_ids"] for o in plain.generate(input_ids=_ids(plain, PROMPTS), sampling_params=GREEDY)]
    _clean(plain)
    assert plain.server_info()["weight_quantization"]["method"] == "awq"
    return reference


@pytest.mark.slow
@pytest.mark.parametrize("flags, batch_sizes", [
    ({"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(SHIPPED_HEAD)}, (1, 8)),
    ({"speculative_algorithm": "NGRAM"}, (8,)),
])
def test_speculation_over_awq_target_is_lossless(smollm2_awq, awq_reference, flags, batch_sizes):
    reference = awq_reference
    engine = Engine(str(smollm2_awq), log_level="warning", speculative_adaptive="off", **EXACT_ON_GPU, **flags)
    results = _check(engine, reference, batch_sizes=batch_sizes)
    assert sum(r["meta_info"]["spec_verify_ct"] for r in results) > 0
