"""The default model served in its GGUF blocks on the CPU (models/gguf_serve.py): the same
weights as the float conversion, greedy outputs like the float model's, speculation
lossless over it, and the flags' errors."""
from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.core import quant
from specserve.core.config import ConfigError
from specserve.kernels import cpu_quant, huge_pages
from specserve.models import gguf_blocks, gguf_serve, loader
from specserve.models.layers import Linear
from specserve.models.loader import load_model
from tests.conftest import SMOLLM2

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler: GGUF weights run dequantized")]
CPU = torch.device("cpu")
PROMPTS = ["Explain how a bicycle works, step by step.", "Write a haiku about the sea.",
           "What is the capital of France? Answer in one sentence.", "List three prime numbers and why."]
GREEDY = {"temperature": 0, "max_new_tokens": 40}


def test_the_blocks_hold_the_float_conversions_weights_exactly(smollm2_dir):
    floats = load_model(smollm2_dir, torch.float32, CPU, "none")
    blocks = load_model(smollm2_dir, torch.float32, CPU)
    assert blocks.weight_quant.method == "gguf" and floats.weight_quant is None
    float_layers = dict(floats.named_modules())
    served = 0
    for name, layer in blocks.named_modules():
        if isinstance(layer, Linear):
            qw, twin = layer.quantized, float_layers[name]
            assert qw is not None and qw.method in (quant.Q4, quant.Q8), name
            assert torch.equal(qw.dequantize(torch.float32), twin.out_in_weight), name  # q/k rows un-permuted too
            served += 1
    assert served == 4 * blocks.config.num_layers
    assert torch.equal(blocks.head_blocks.dequantize(torch.float32), floats.lm_head.weight)  # tied: token_embd


def test_layers_in_blocks_never_read_nor_allocate_float_weights(smollm2_dir, monkeypatch):
    """A 4-bit file's float model is about 7x its size: the loader reads no float tensor of
    a layer its blocks serve (only the norms and the embedding), and such a layer's float
    weight has no rows until it takes its blocks."""
    read: list[str] = []
    real_iter, real_apply = loader.iter_safetensors, gguf_serve.apply

    def reading(*args, **kwargs):
        for name, tensor in real_iter(*args, **kwargs):
            read.append(name)
            yield name, tensor

    def applying(model, blocks, *args):
        assert len(blocks.layers) == 4 * model.config.num_layers
        for name in blocks.layers:
            assert model.get_submodule(name).out_in_weight.numel() == 0, name
        return real_apply(model, blocks, *args)

    monkeypatch.setattr(loader, "iter_safetensors", reading)
    monkeypatch.setattr(gguf_serve, "apply", applying)
    model = load_model(smollm2_dir, torch.float32, CPU)
    assert model.weight_quant.method == "gguf"
    assert "model.embed_tokens.weight" in read and all(
        name == "model.embed_tokens.weight" or name.endswith("norm.weight") for name in read), read


def _file_mapped(t: torch.Tensor, name: str) -> bool:
    """Whether `t`'s memory lies in a mapping of the file called `name` (Linux)."""
    at = t.data_ptr()
    with open("/proc/self/maps") as maps:
        spans = [line.split()[0].split("-") for line in maps if line.rstrip().endswith(name)]
    return any(int(lo, 16) <= at < int(hi, 16) for lo, hi in spans)


def test_the_blocks_and_the_embedding_are_the_files_pages_not_copies(smollm2_dir):
    model = load_model(smollm2_dir, torch.float32, CPU)
    fused = {"qkv_proj", "gate_up_proj"}
    assert fused <= {name.split(".")[-2] for name in gguf_blocks.methods(smollm2_dir / gguf_blocks.BLOCKS_FILE)}
    held = [m.quantized for m in model.modules() if isinstance(m, Linear)] + [model.head_blocks]
    assert len(held) == 4 * model.config.num_layers + 1
    for qw in held:  # every process serving the model shares these pages (and the page cache)
        assert all(_file_mapped(t, "blocks.safetensors") for t in (qw.data, qw.scale, qw.zeros) if t is not None)
        assert _file_mapped(cpu_quant.pack(qw).data, gguf_serve.CPU_LAYOUT_FILE)  # and the kernels' layout
    table = model.model.embed_tokens.weight  # the float embedding, and the head tied to it
    assert model.lm_head.weight is table and _file_mapped(table, "model.safetensors")
    floats = load_model(smollm2_dir, torch.float32, CPU, "none")
    assert torch.equal(table, floats.model.embed_tokens.weight)


@pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages on this system")
def test_a_lone_process_copies_the_layouts_into_huge_pages(smollm2_dir):
    """`private` (one engine process, --dp 1): the kernels' layouts leave the shared file for
    huge pages, the same bytes; the blocks themselves stay the file's pages."""
    shared = load_model(smollm2_dir, torch.float32, CPU)
    shared_layouts = [cpu_quant.pack(m.quantized).data.clone() for m in shared.modules()
                      if isinstance(m, Linear) and m.quantized is not None]
    model = load_model(smollm2_dir, torch.float32, CPU, private=True)
    held = [m.quantized for m in model.modules() if isinstance(m, Linear) and m.quantized is not None]
    for qw, want in zip(held, shared_layouts, strict=True):
        layout = cpu_quant.pack(qw).data
        assert not _file_mapped(layout, gguf_serve.CPU_LAYOUT_FILE) and torch.equal(layout, want)
        assert _file_mapped(qw.data, "blocks.safetensors")


@pytest.fixture(scope="module")
def served_outputs(smollm2_dir) -> list[list[int]]:
    """Greedy outputs of the default model as the CPU serves it: in its blocks."""
    with Engine(str(smollm2_dir), log_level="warning") as served:
        info = served.server_info()["weight_quantization"]
        assert info["method"] == "gguf" and info["bytes_per_weight"] < 1.0, info
        outs = [o["output_ids"] for o in served.generate(PROMPTS, GREEDY)]
        assert served.kv_leak() is None
    return outs


def test_greedy_outputs_follow_the_float_model(smollm2_dir, served_outputs):
    with Engine(str(smollm2_dir), log_level="warning", quantization="none") as floats:
        want = [o["output_ids"] for o in floats.generate(PROMPTS, GREEDY)]
    same = sum(g == w for g, w in zip(served_outputs, want))
    assert same >= len(PROMPTS) - 1, (same, served_outputs, want)  # float32 rounding alone tells them apart


@pytest.mark.parametrize("flags", [{"speculative_algorithm": "NGRAM"},
                                   {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
                                    "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6}],
                         ids=["NGRAM", "EAGLE3"])
def test_speculation_is_lossless_over_the_blocks(served_outputs, flags):
    with Engine(SMOLLM2, log_level="warning", **flags) as spec:  # by name: EAGLE3 takes the shipped head
        assert spec.server_info()["weight_quantization"]["method"] == "gguf"
        got = [o["output_ids"] for o in spec.generate(PROMPTS, GREEDY)]
        assert spec.kv_leak() is None
    assert got == served_outputs


def test_cpu_threads_sets_the_threads_and_changes_no_output(smollm2_dir, served_outputs):
    before = torch.get_num_threads()
    try:
        with Engine(str(smollm2_dir), log_level="warning", cpu_threads=1) as one:
            assert torch.get_num_threads() == 1
            assert one.generate(PROMPTS[:2], GREEDY)[1]["output_ids"] == served_outputs[1]
    finally:
        torch.set_num_threads(before)


def test_flags_that_cannot_apply_fail_at_start_up(smollm2_dir, tmp_path):
    from tests.unit.model_utils import save_tiny_hf

    tiny = save_tiny_hf("llama", tmp_path / "tiny")
    with pytest.raises(ConfigError, match="needs a GGUF model"):
        load_model(tiny, torch.float32, CPU, "gguf")
    with pytest.raises(ConfigError, match="deterministic"):
        load_model(smollm2_dir, torch.float32, CPU, "gguf", gguf_ok=False)
    assert load_model(smollm2_dir, torch.float32, CPU, None, gguf_ok=False).weight_quant is None


@pytest.mark.parametrize("flag", [None, "unquant"])
def test_an_eagle3_draft_follows_a_blocks_target_unless_kept_unquantized(smollm2_dir, flag):
    from specserve.models.draft_loader import load_draft
    from specserve.spec.eagle import LAYOUTS
    from specserve.spec.eagle.shipped_heads import shipped_head

    target = load_model(smollm2_dir, torch.float32, CPU)
    draft = load_draft(shipped_head(smollm2_dir, "EAGLE3"), target, LAYOUTS["EAGLE3"], torch.float32, CPU,
                       quantization=flag)
    held = [m.quantized for m in draft.modules() if isinstance(m, Linear)]
    if flag == "unquant":
        assert draft.head_blocks is None and all(qw is None for qw in held) and draft.cpu_stack is None
        return
    assert held and all(qw is not None and qw.method == quant.Q8 for qw in held)
    assert draft.cpu_stack is not None  # its midlayer in one C call
    assert draft.head_blocks is not None and draft.head_blocks.shape == tuple(draft.lm_head.weight.shape)
    h = torch.randn(3, draft.config.hidden_size)
    want = h @ draft.lm_head.weight.t()  # within Q8_0's rounding of the float head
    torch.testing.assert_close(draft.compute_logits(h), want, rtol=0.0, atol=0.02 * want.abs().max().item())


def _draft_steps(draft, features: torch.Tensor, ids: list[int], c_stack: bool) -> list[torch.Tensor]:
    """The draft's (h_logits, h_next) of a 6-token extend, then 2 more tokens over its KV,
    with its midlayer in C or in torch."""
    from specserve.attention.torch_ref import TorchRefBackend
    from specserve.cache.kv_pool import KVPool
    from specserve.cache.req_table import ReqToTokenTable
    from specserve.core.forward_batch import ForwardBatch, ForwardMode

    cfg, stack = draft.config, draft.cpu_stack
    pool = KVPool(64, 1, cfg.kv_heads_per_rank, cfg.head_dim, torch.float32, CPU)
    table, backend, outs = ReqToTokenTable(2, 64, CPU), TorchRefBackend(), []
    draft.cpu_stack = stack if c_stack else None
    try:
        for start, n in ((0, 6), (6, 2)):
            slots = torch.arange(1 + start, 1 + start + n)
            table.write(0, start, slots)
            fb = ForwardBatch(ForwardMode.EXTEND, torch.tensor(ids[start:start + n]), torch.arange(start, start + n),
                              slots, torch.tensor([0]), [start], [n], table.table, pool, backend,
                              logit_rows=torch.arange(n))
            backend.init_forward_metadata(fb)
            with torch.inference_mode():
                outs += list(draft(fb, features[start:start + n]))
    finally:
        draft.cpu_stack = stack
    return outs


def test_an_eagle3_midlayer_in_c_follows_its_torch_path(smollm2_dir):
    from specserve.models.draft_loader import load_draft
    from specserve.spec.eagle import LAYOUTS
    from specserve.spec.eagle.shipped_heads import shipped_head

    target = load_model(smollm2_dir, torch.float32, CPU)
    draft = load_draft(shipped_head(smollm2_dir, "EAGLE3"), target, LAYOUTS["EAGLE3"], torch.float32, CPU)
    features = torch.randn(8, 3 * target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    ids = [5, 17, 99, 3, 250, 41, 8, 77]
    got, want = (_draft_steps(draft, features, ids, c) for c in (True, False))
    # both round each product's x to int16; the norms and attention differ in float32's last bits
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-3 * w.abs().max().item())
