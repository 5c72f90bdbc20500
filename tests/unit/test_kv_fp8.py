"""The fp8 KV cache (--kv-cache-dtype fp8_e4m3): stores, reads, budget, flags, and speculation.

Every writer (`KVPool.write`, the store kernels in kernels/rope.py and kernels/qkv_rope.py)
must write the same bytes, stored = e4m3(clamp(x / scale, +-448)); every reader (the torch
reference, the three Triton attention kernels) must see stored * scale. The kernels run
compiled on CUDA and under TRITON_INTERPRET=1 on the CPU, whose fp8 rounding
`triton_interp.py` makes round-to-nearest-even, as the GPU's. Scales other than 1 make a
reader that forgets one, or a writer that divides where it should not, show.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specserve import kernels
from specserve.attention.torch_ref import TorchRefBackend
from specserve.attention.triton_backend import TritonBackend
from specserve.cache.kv_pool import KVPool, quantize
from specserve.core.config import CacheConfig, ConfigError
from specserve.core.forward_batch import ForwardBatch, ForwardMode
from specserve.models.rope import RotaryEmbedding, apply_rope
from specserve.spec.drafts import Drafts
from tests.unit.triton_interp import DEV  # also makes the interpreter round to fp8 as GPUs do

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.5, 2.0
NUM_SLOTS, MAX_REQS, MAX_CONTEXT, LAYER = 400, 8, 256, 1


def _layout(prefix_lens: list[int], extend_lens: list[int], g: torch.Generator):
    """A table with rows 0..B-1 on random distinct slots: (table, rows, out_slots)."""
    table = torch.zeros(MAX_REQS, MAX_CONTEXT, dtype=torch.int64)
    slots, out, used = torch.randperm(NUM_SLOTS, generator=g) + 1, [], 0
    for b, (p, n) in enumerate(zip(prefix_lens, extend_lens)):
        table[b, :p + n] = slots[used:used + p + n]
        out.append(slots[used + p:used + p + n])
        used += p + n
    return table.to(DEV), torch.arange(len(prefix_lens), device=DEV), torch.cat(out).to(DEV)


def _attend(backend, values: list[torch.Tensor], dtype, layout, prefix_lens, extend_lens, qkv, masks=None,
            mode=ForwardMode.EXTEND) -> tuple[torch.Tensor, KVPool]:
    """One layer's attention output [T, H*D] over a pool of `dtype` holding `values` (K and V
    of layers 0 and 1, rounded as the pool stores them), and the pool after the forward."""
    q, k, v = qkv
    pool = KVPool(NUM_SLOTS, 2, k.shape[1], k.shape[2], dtype, DEV, k_scale=K_SCALE, v_scale=V_SCALE)
    for cache, x, scale in zip(pool.k + pool.v, values, (K_SCALE,) * 2 + (V_SCALE,) * 2):
        cache.copy_(quantize(x, scale, dtype))
    table, rows, out_slots = layout
    zeros = torch.zeros(q.shape[0], dtype=torch.int64, device=DEV)
    fb = ForwardBatch(mode, zeros, zeros, out_slots, rows, prefix_lens, extend_lens, table, pool, backend,
                      custom_masks=masks)
    backend.init_forward_metadata(fb)
    with torch.no_grad():
        return backend.forward(q, k, v, LAYER, fb, q.shape[2] ** -0.5), pool


def _inputs(prefix_lens, extend_lens, heads, kv_heads, dim, q_dtype=torch.float32, seed=0):
    """(layout, the pool's K/V values [k0, k1, v0, v1], of about 3 once divided by the
    scales, and the new q/k/v)."""
    g = torch.Generator().manual_seed(seed)
    layout = _layout(prefix_lens, extend_lens, g)
    shape = (NUM_SLOTS + 1, kv_heads, dim)
    values = [(torch.randn(shape, generator=g) * 3 * s).to(DEV) for s in (K_SCALE,) * 2 + (V_SCALE,) * 2]
    total = sum(extend_lens)
    qkv = [(torch.randn(total, h, dim, generator=g) * 2).to(DEV, q_dtype) for h in (heads, kv_heads, kv_heads)]
    return layout, values, qkv


# ---- (a) every Triton attention kernel reads an fp8 pool as the reference does -------------

TREE = Drafts.from_lists([[1, 2, 3, 4, 5, 6], [1, 2, 3], [7]], [[-1, 0, 0, 1, 3, 2], [-1, 0, 0], [-1]])
CASES = {  # name: (prefix_lens, extend_lens, mode, heads, kv_heads, dim, splits)
    "decode": ([0, 70, 140, 9], [1, 1, 1, 1], ForwardMode.DECODE, 4, 2, 32, None),
    "decode_splits": ([0, 70, 140, 9], [1, 1, 1, 1], ForwardMode.DECODE, 8, 2, 16, 3),
    "extend": ([0, 37, 80], [5, 20, 130], ForwardMode.EXTEND, 4, 2, 16, None),  # 130 * 2 rows: the extend kernel
    "verify": ([12, 150, 0], [6, 3, 1], ForwardMode.VERIFY, 4, 2, 32, 2),  # the short-extend kernel
}


@pytest.mark.parametrize("case", list(CASES))
def test_triton_kernels_read_fp8_as_the_reference(case):
    prefix_lens, extend_lens, mode, heads, kv_heads, dim, splits = CASES[case]
    layout, values, qkv = _inputs(prefix_lens, extend_lens, heads, kv_heads, dim)
    masks = None
    if mode == ForwardMode.VERIFY:
        masks = [m[:n, :n].to(DEV) for m, n in zip(TREE.tree_mask(), extend_lens)]
    ref, ref_pool = _attend(TorchRefBackend(), values, FP8, layout, prefix_lens, extend_lens, qkv, masks, mode)
    got, got_pool = _attend(TritonBackend(DEV, splits), values, FP8, layout, prefix_lens, extend_lens, qkv,
                            masks, mode)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(got_pool.k + got_pool.v, ref_pool.k + ref_pool.v):  # the new tokens' K/V: KVPool.write
        assert a.dtype == FP8 and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_half_queries_over_an_fp8_pool():
    """The products run in the queries' dtype beside an fp8 pool (upcast blocks, exact)."""
    prefix_lens, extend_lens = [30, 0, 90], [1, 1, 1]
    layout, values, qkv = _inputs(prefix_lens, extend_lens, 4, 2, 32, q_dtype=torch.float16, seed=1)
    ref, _ = _attend(TorchRefBackend(), values, FP8, layout, prefix_lens, extend_lens, qkv, mode=ForwardMode.DECODE)
    got, _ = _attend(TritonBackend(DEV), values, FP8, layout, prefix_lens, extend_lens, qkv, mode=ForwardMode.DECODE)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


# ---- (c) the reference over an fp8 pool stays close to the full-precision pool --------------

def test_fp8_pool_is_close_to_the_float32_pool():
    prefix_lens, extend_lens = [50, 120, 0], [1, 4, 9]
    layout, values, qkv = _inputs(prefix_lens, extend_lens, 4, 2, 32, seed=2)
    exact, _ = _attend(TorchRefBackend(), values, torch.float32, layout, prefix_lens, extend_lens, qkv)
    fp8, _ = _attend(TorchRefBackend(), values, FP8, layout, prefix_lens, extend_lens, qkv)
    err = (fp8 - exact).norm() / exact.norm()
    assert 0 < err < 0.08, err  # e4m3 keeps 3 mantissa bits: ~3.6% RMS error per stored element


# ---- (b) the store kernels write the bytes KVPool.write writes ------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_store_kv_writes_the_pools_fp8_bytes(dtype):
    tokens, heads, kv_heads, dim = 6, 4, 2, 64
    rot = RotaryEmbedding(dim, 256, 10000.0, None)
    rot.build(DEV, dtype)
    cos, sin = rot.lookup(torch.randint(0, 256, (tokens,), device=DEV))
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, dim, device=DEV) * 300).to(dtype)  # some saturate
    slots = torch.tensor([5, 9, 3, 2, 7, 1], device=DEV)
    got = KVPool(12, 1, kv_heads, dim, FP8, DEV, k_scale=K_SCALE, v_scale=V_SCALE)
    ref = KVPool(12, 1, kv_heads, dim, FP8, DEV, k_scale=K_SCALE, v_scale=V_SCALE)
    with kernels.fused_kernels(True):
        kernels.rope_store_kv(qkv, heads, cos, sin, got.k[0], got.v[0], slots, k_scale=K_SCALE, v_scale=V_SCALE)
    with kernels.fused_kernels(False):
        qk = apply_rope(qkv[:, :heads + kv_heads], cos, sin)
    ref.write(0, slots, qk[:, heads:], qkv[:, heads + kv_heads:])
    assert got.k[0].float().abs().max() == 448  # saturated, not NaN
    if DEV.type == "cuda":  # compiled, the rotation's sum may round once differently (rope.py): one e4m3 step
        assert (got.k[0].view(torch.uint8).int() - ref.k[0].view(torch.uint8).int()).abs().max() <= 1
    else:
        assert torch.equal(got.k[0].view(torch.uint8), ref.k[0].view(torch.uint8))
    assert torch.equal(got.v[0].view(torch.uint8), ref.v[0].view(torch.uint8))


def test_qkv_rope_store_quantizes_what_it_would_store():
    """The fused projection + RoPE + store into an fp8 cache writes quantize() of what it
    writes into a float32 cache (the same programs, so the same values before rounding)."""
    from specserve.kernels import qkv_rope

    tokens, heads, kv_heads, dim, k = 5, 4, 2, 32, 64
    rot = RotaryEmbedding(dim, 256, 10000.0, None)
    rot.build(DEV, torch.float32)
    rope = rot.at(torch.randint(0, 256, (tokens,), device=DEV))
    x = torch.randn(tokens, k, device=DEV)
    w = torch.randn((heads + 2 * kv_heads) * dim, k, device=DEV) * 4
    slots = torch.tensor([3, 8, 1, 6, 2], device=DEV)
    wide = [torch.zeros(10, kv_heads, dim, device=DEV) for _ in range(2)]
    fp8 = [torch.zeros(10, kv_heads, dim, device=DEV, dtype=FP8) for _ in range(2)]
    with kernels.fused_kernels(True), torch.no_grad():
        qkv_rope.qkv_rope_store(x, w, heads, rope, *wide, slots)
        qkv_rope.qkv_rope_store(x, w, heads, rope, *fp8, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    for got, want, scale in zip(fp8, wide, (K_SCALE, V_SCALE)):
        assert torch.equal(got.view(torch.uint8), quantize(want, scale, FP8).view(torch.uint8))


@pytest.mark.parametrize("skinny", [True, False])
def test_the_model_passes_the_scales_to_every_store(tmp_path, skinny, monkeypatch):
    """models/llama.py's three store call sites (a 9-token extend: qkv_rope.py with the
    few-token layers, rope.py without; a decode: rope.py after the GEMV) fill an fp8 pool
    as the torch path does: the same bytes but where the projections' last bits differ
    across a rounding boundary (one e4m3 step), and close logits."""
    from specserve.models.loader import load_model
    from tests.unit.model_utils import BareRunner, save_tiny_hf

    monkeypatch.setenv("SPECSERVE_SKINNY", "1" if skinny else "0")
    model = load_model(save_tiny_hf("llama", tmp_path / "m", vocab_size=64, num_hidden_layers=1), torch.float32, DEV)
    cfg, runs = model.config, []
    for fused in (True, False):
        with kernels.fused_kernels(fused):
            r = BareRunner(model)
            r.pool = KVPool(64, cfg.num_layers, cfg.kv_heads_per_rank, cfg.head_dim, FP8, DEV, K_SCALE, V_SCALE)
            logits = [r.forward([0], [0], [[5, 17, 60, 3, 25, 7, 1, 42, 8]])]
            if skinny:  # the interpreter's GEMV is slow: one decode is enough
                logits.append(r.forward([0], [9], [[33]], mode=ForwardMode.DECODE))
        runs.append((torch.cat(logits), r.pool))
    (got, got_pool), (ref, ref_pool) = runs
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    for a, b in zip(got_pool.k + got_pool.v, ref_pool.k + ref_pool.v):
        a, b = a[1:11].float(), b[1:11].float()  # the tokens' slots
        assert (a != b).float().mean() < 0.02 and ((a - b).abs() <= b.abs() / 8 + 2 ** -9).all()
        assert b.abs().sum() > 0


# ---- the pool, its budget and the flags ------------------------------------------------------

def test_an_fp8_slot_takes_half_the_bytes_and_the_budget_doubles():
    from specserve.runner.model_runner import CPU_KV_BUDGET_BYTES, ModelRunner

    assert KVPool.bytes_per_slot(30, 3, 64, FP8) * 2 == KVPool.bytes_per_slot(30, 3, 64, torch.bfloat16)
    budgets = []
    for dtype in (torch.bfloat16, FP8):
        cfg = SimpleNamespace(num_layers=30, kv_heads_per_rank=3, head_dim=64)
        runner = SimpleNamespace(model=SimpleNamespace(config=cfg), kv_dtype=dtype, device=torch.device("cpu"),
                                 context_length=50_000)
        budgets.append(ModelRunner._kv_budget(runner, CacheConfig()))
    assert budgets == [CPU_KV_BUDGET_BYTES // (2 * 30 * 3 * 64 * 2), CPU_KV_BUDGET_BYTES // (2 * 30 * 3 * 64)]


def test_fp8_needs_compute_capability_8_9(monkeypatch):
    from specserve.runner.memory import kv_cache_dtype

    assert kv_cache_dtype("auto", torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    assert kv_cache_dtype("fp8_e4m3", torch.float32, torch.device("cpu")) == FP8
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match=r"^--kv-cache-dtype fp8_e4m3 needs a GPU of compute capability 8\.9"):
        kv_cache_dtype("fp8_e4m3", torch.bfloat16, torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert kv_cache_dtype("fp8_e4m3", torch.bfloat16, torch.device("cuda", 0)) == FP8


def test_kv_cache_dtype_flag():
    from specserve.args import parse_config

    def dtype(*argv: str) -> str:
        return parse_config(list(argv), device_has_cuda=False).cache.kv_cache_dtype

    assert dtype() == "auto"
    assert dtype("--kv-cache-dtype", "fp8_e4m3") == dtype("--kv-cache-dtype", "fp8") == "fp8_e4m3"
    with pytest.raises(ConfigError, match=r"^--kv-cache-dtype fp8_e5m2 is not supported: use fp8_e4m3 or auto$"):
        dtype("--kv-cache-dtype", "fp8_e5m2")
    with pytest.raises(ConfigError, match=r"^--kv-cache-dtype int4: expected one of auto, fp8_e4m3$"):
        dtype("--kv-cache-dtype", "int4")


# ---- (d) speculation over an fp8 cache is still exactly greedy -------------------------------

def _greedy(engine, prompts: list[list[int]]) -> list[list[int]]:
    kv = engine.scheduler.kv
    free = kv.allocator.available
    outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 24})
    assert not engine.scheduler.has_work
    kv.flush_cache()
    kv.assert_no_leak()
    assert kv.allocator.available == free
    return [o["output_ids"] for o in outs]


def test_speculation_over_an_fp8_cache_is_greedy_exact(tmp_path, smollm2_dir):
    from tests.unit import eagle_utils
    from tests.unit import perfect_draft as pd

    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], [12, 12, 12, 12, 12], [40, 41, 40, 41]]
    fp8 = {"kv_cache_dtype": "fp8_e4m3"}
    target = pd.make_target(tmp_path / "target")
    plain = eagle_utils.engine(target, smollm2_dir, **fp8)
    assert plain.scheduler.runner.kv_pool.k[0].dtype == FP8
    assert plain.server_info()["kv_cache_dtype"] == "fp8_e4m3"
    want = _greedy(plain, prompts)
    ngram = eagle_utils.engine(target, smollm2_dir, speculative_algorithm="NGRAM", speculative_adaptive="off", **fp8)
    assert _greedy(ngram, prompts) == want
    eagle_flags = eagle_utils.spec_flags("EAGLE", pd.perfect_eagle2(tmp_path / "draft", target), "tree")
    eagle = eagle_utils.engine(target, smollm2_dir, **eagle_flags, **fp8)
    assert eagle.scheduler.spec.proposer.pool.k[0].dtype == FP8  # the draft's pool follows the target's
    assert _greedy(eagle, prompts) == want
    assert eagle.scheduler.spec.stats.avg_accept_length > 1.5
