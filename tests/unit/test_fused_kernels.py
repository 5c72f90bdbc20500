"""The fused Triton kernels (specserve.kernels) against the torch path they replace.

On CUDA the kernels run compiled; on CPU under TRITON_INTERPRET=1 (set before triton is
first imported: `fused_utils.py`). Each check flips `fused_kernels(True/False)` around the
same module call, so the reference is the very code path CPU inference runs. The
speculative step's kernels are in `test_tree_kernels.py`; the few-token path's choices and
launch shapes in `test_skinny_config.py`.
"""
from __future__ import annotations

import pytest  # noqa: E402
import torch

from tests.unit.fused_utils import DEV, DTYPES, gpu_float32_tiles  # first: sets TRITON_INTERPRET on CPU
from tests.unit.fused_utils import both as _both

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from specserve import kernels  # noqa: E402
from specserve.core.forward_batch import ForwardMode  # noqa: E402
from specserve.models.layers import RMSNorm  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402
from specserve.models.rope import RotaryEmbedding, apply_rope  # noqa: E402
from specserve.spec.eagle import LAYOUTS  # noqa: E402
from tests.unit.model_utils import BareRunner, save_tiny_hf  # noqa: E402


def _close(got: torch.Tensor, ref: torch.Tensor, half_tol: float = 1e-2) -> None:
    """float32: a few ulp (the reduction order differs). Half types: one ulp at most
    (fp32 rsqrt/exp differ by ulps before rounding), or half_tol where the fused form
    rounds elsewhere (the deferred norm: at x * weight, not at x * rstd)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got, ref, rtol=half_tol, atol=half_tol)


def _norm(n: int, dtype: torch.dtype) -> RMSNorm:
    m = RMSNorm(n, 1e-6).to(DEV, dtype)
    with torch.no_grad():
        m.weight.copy_(1 + 0.3 * torch.randn(n))
    return m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 576, 4096, 8192])
@pytest.mark.parametrize("tokens", [1, 7])
def test_rms_norm_and_fused_add(n, tokens, dtype):
    torch.manual_seed(n + tokens)
    m = _norm(n, dtype)
    x, r = (torch.randn(tokens, n, device=DEV).to(dtype) for _ in range(2))
    got, ref = _both(lambda: m(x))
    _close(got, ref)
    x_in, r_in = x.clone(), r.clone()
    (out, res), (out0, res0) = _both(lambda: m.forward_add(x, r))
    assert torch.equal(res, res0)  # the residual sum is one rounded add: exact
    _close(out, out0)
    assert torch.equal(x, x_in) and torch.equal(r, r_in)  # out of place: callers may keep r (aux)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_on_strided_heads(dtype):
    # Qwen3's per-head q/k norm reads head slices of the qkv projection: a strided 3-D view
    qkv = torch.randn(5, 4 + 2 * 2, 16, device=DEV).to(dtype)
    m = _norm(16, dtype)
    got, ref = _both(lambda: m(qkv[:, :4]))
    _close(got, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,n", [(1, 64), (6, 576), (3, 1000)])
@pytest.mark.parametrize("gather", [False, True])
def test_rms_norm_pair_is_two_norms_and_a_cat(tokens, n, dtype, gather):
    """EAGLE-3's midlayer input, cat(norm(embeds), norm(hidden)), in one launch; the
    hidden may be a row slice of a wider tensor. `gather`: the launch reads the embeddings
    from the table at the ids itself (an id past the table reads zeros, as the gather does)."""
    ma, mb = _norm(n, dtype), _norm(n, dtype)
    b = torch.randn(tokens, 2 * n, device=DEV).to(dtype)[:, n:]
    table = torch.randn(7, n, device=DEV).to(dtype)
    ids = torch.tensor([3, 0, 6, 9, 3, 1][:tokens], device=DEV)
    a = torch.cat([table, torch.zeros(3, n, device=DEV, dtype=dtype)])[ids] if gather else table[:tokens]
    got = kernels.rms_norm_pair(table if gather else a, ma.weight, b, mb.weight, ma.eps, ids=ids if gather else None)
    with kernels.fused_kernels(False), torch.no_grad():
        _close(got, torch.cat([ma(a), mb(b)], dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 96), (5, 1536), (3, 2000)])
def test_silu_and_mul(tokens, inter, dtype):
    gate_up = 3 * torch.randn(tokens, 2 * inter, device=DEV).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(kernels.silu_and_mul(gate_up), F.silu(gate) * up)


def _check_fused_forms(x: torch.Tensor, w: torch.Tensor, wg: torch.Tensor, res: torch.Tensor, norm) -> None:
    """kernels.gemv's forms against the torch ops they replace: F.linear, RMSNorm before
    it, the residual add after it, SiLU*mul over gate_up's halves."""
    with kernels.fused_kernels(False):
        normed = norm(x)
    _close(kernels.gemv(x, w), F.linear(x, w))
    _close(kernels.gemv(x, w, norm_weight=norm.weight, eps=norm.eps), F.linear(normed, w), 2e-2)
    _close(kernels.gemv(x, w, residual=res), res + F.linear(x, w))
    gate, up = F.linear(normed, wg).chunk(2, dim=-1)
    _close(kernels.gemv(x, wg, norm_weight=norm.weight, eps=norm.eps, gated=True), F.silu(gate) * up, 2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(7, 64), (96, 576), (33, 2500)])  # odd rows; K under, at, over a block
@pytest.mark.parametrize("transposed", [False, True])  # the CPU's [in, out] weight layout
def test_gemv_is_the_unfused_chain(n, k, dtype, transposed):
    """Each fused form against the torch ops it replaces: F.linear, RMSNorm before it,
    the residual add after it, SiLU*mul over gate_up's halves; float32 logits are the
    x-dtype result widened."""
    x = torch.randn(1, k, device=DEV).to(dtype)
    res = torch.randn(1, n, device=DEV).to(dtype)
    w, wg = (torch.randn(rows, k, device=DEV).div(k ** 0.5).to(dtype) for rows in (n, 2 * n))
    if transposed:
        w, wg = (t.t().contiguous().t() for t in (w, wg))
    _check_fused_forms(x, w, wg, res, _norm(k, dtype))
    logits = kernels.gemv(x, w, out_dtype=torch.float32)  # the x-dtype result, widened
    assert logits.dtype == torch.float32 and torch.equal(logits, kernels.gemv(x, w).float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_token_narrow_head_takes_the_tiles(dtype, monkeypatch):
    """One token through a narrow lm_head (16384 rows or more, K <= SKINNY_MAX_WIDTH) runs
    on skinny.py's tiles, not the GEMV: the same logits, float32 the x-dtype ones widened;
    fewer rows, a gated weight or SPECSERVE_SKINNY=0 keep the GEMV."""
    from specserve.kernels import matvec, skinny

    x = torch.randn(1, 64, device=DEV).to(dtype)
    w = torch.randn(16384, 64, device=DEV).div(8).to(dtype)
    calls = []
    for mod, name in ((skinny, "skinny"), (matvec, "gemv")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    logits = kernels.gemv(x[0], w, out_dtype=torch.float32)
    assert calls == ["skinny"] and logits.shape == (1, 16384)
    half = kernels.gemv(x, w)
    _close(half, F.linear(x, w))
    assert torch.equal(logits, half.float())
    assert not kernels._narrow_head(w[:16383], False) and not kernels._narrow_head(w, True)
    monkeypatch.setenv("SPECSERVE_SKINNY", "0")
    assert not kernels._narrow_head(w, False)


def _random_forms(t: int, n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every fused form (`_check_fused_forms`) on random x [t, k], weights [n, k] and
    [2n, k], a residual and a norm; returns (x, the plain weight) for further checks."""
    x = torch.randn(t, k, device=DEV).to(dtype)
    res = torch.randn(t, n, device=DEV).to(dtype)
    w, wg = (torch.randn(rows, k, device=DEV).div(k ** 0.5).to(dtype) for rows in (n, 2 * n))
    _check_fused_forms(x, w, wg, res, _norm(k, dtype))
    return x, w


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the L2 prefetch is inline PTX: CUDA only")
def test_l2_prefetch_leaves_the_products_bit_identical(monkeypatch):
    """A gated, normed 32-token product (the verify's gate_up) with and without the
    prefetch: hints only, so the outputs are equal bit for bit."""
    from specserve.kernels import pdl, skinny

    x = torch.randn(32, 576, device=DEV).to(torch.bfloat16)
    wg = torch.randn(3072, 576, device=DEV).div(24).to(torch.bfloat16)
    norm = _norm(576, torch.bfloat16)
    cfg = skinny._config(1536, 576, True, True, 2, 32, DEV)
    assert pdl.prefetch_step(wg, cfg.block_k, cfg.split) == 64
    with kernels.fused_kernels(True):
        on = kernels.gemv(x, wg, norm_weight=norm.weight, eps=norm.eps, gated=True)
        monkeypatch.setattr(pdl, "L2_PREFETCH", False)
        off = kernels.gemv(x, wg, norm_weight=norm.weight, eps=norm.eps, gated=True)
    assert torch.equal(on, off)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n,k", [(2, 7, 64), (16, 96, 576), (23, 33, 300), (5, 20, 1100)])
def test_skinny_is_the_unfused_chain(t, n, k, dtype):
    """The few-token kernel (skinny.py) against the same torch ops, per token: tokens
    padded to 16 and 32, one K tile and several (1100), so the norm's exact form (one
    tile, 16 tokens) and its deferred form (32 tokens, several tiles, gated)."""
    x, w = _random_forms(t, n, k, dtype)
    _close(kernels.gemv(x, w.t().contiguous().t()), F.linear(x, w))  # the CPU's [in, out] layout


@pytest.mark.parametrize("dtype", DTYPES)  # not bf16 on CPU: the interpreter's descriptors lack it
@pytest.mark.parametrize("t,n,k", [(2, 7, 64), (16, 96, 1104), (23, 70, 584)])
def test_skinny_tma_is_the_unfused_chain(t, n, k, dtype, monkeypatch):
    """Weights streamed through TMA descriptors (skinny.use_tma forced; 64-row boxes, 256
    or 128 columns deep) give every fused form as the torch ops do: rows and columns past
    the weight's edges read as zeros (7 and 70 rows, 584 and 1104 columns)."""
    from specserve.kernels import skinny

    monkeypatch.setattr(skinny, "TMA_OVERRIDE", True)
    _random_forms(t, n, k, dtype)


def _force_split(monkeypatch, module, split: int) -> None:
    """The module's few-token launches split K over `split` programs (skinny._config's
    choice otherwise)."""
    config = module._config
    monkeypatch.setattr(module, "_config", lambda *a: config(*a)._replace(split=split))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [2, 3])
@pytest.mark.parametrize("t,n,k", [(5, 20, 1100), (16, 96, 576), (23, 33, 300)])
def test_skinny_split_k_is_the_unfused_chain(t, n, k, split, dtype, monkeypatch):
    """K split over programs (skinny.split_sum: parts summed by the last to arrive) gives
    every fused form, the norm deferred, as the torch ops do; a part may hold no columns
    (300 in 3 parts of 256-deep tiles); the counts are 0 again after every launch."""
    from specserve.kernels import skinny

    _force_split(monkeypatch, skinny, split)
    _random_forms(t, n, k, dtype)
    assert not skinny._counts(DEV).any()


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])  # 2-byte weights' tiles
@pytest.mark.parametrize("t,n,k", [(4, 40, 2200), (5, 24, 1100)])
def test_skinny_mid_width_tiles_are_the_unfused_chain(t, n, k, dtype):
    """Qwen2.5's layer shapes' launches (skinny_config._mid_width): a long row's 32-row,
    128-deep tiles with K split 4 ways (the last part's final tile partly past K), and a
    gated layer's 32 x 128 tiles, give every fused form as the torch ops do."""
    from specserve.kernels import skinny

    if k > 2048:
        assert tuple(skinny._config(n, k, False, False, 2, 16, DEV))[:4] == (32, 128, 4, 4)
    assert tuple(skinny._config(n, k, True, True, 2, 16, DEV))[:2] == (32, 128)
    _random_forms(t, n, k, dtype)
    assert not skinny._counts(DEV).any()


@pytest.mark.parametrize("t,n,k", [(5, 20, 1100), (16, 96, 576), (23, 33, 300)])
def test_skinny_float32_tiles_are_the_unfused_chain(t, n, k, monkeypatch):
    """float32 on a GPU's launch shapes (skinny_config.f32_config for 132 SMs: 16 x 32
    tiles, K split 4 to 12 ways) with 3xTF32 products gives every fused form as the torch
    ops do."""
    from specserve.kernels import skinny

    gpu_float32_tiles(monkeypatch, skinny)
    assert skinny._config(n, k, False).split > 1
    _random_forms(t, n, k, torch.float32)
    assert not skinny._counts(DEV).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 4, 2, 16), (6, 8, 2, 64), (3, 2, 1, 128)])
def test_rope_on_qk_view(tokens, heads, kv_heads, dim, dtype):
    rot = RotaryEmbedding(dim, 256, 10000.0, None)
    rot.build(DEV, dtype)
    cos, sin = rot.lookup(torch.randint(0, 256, (tokens,), device=DEV))
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, device=DEV).to(dtype)
    qk = qkv[:, :heads + kv_heads]  # the strided view Attention rotates
    got, ref = _both(lambda: apply_rope(qk, cos, sin))
    assert got.is_contiguous()
    if dtype == torch.float32:  # the fp32 sum may be contracted to an FMA
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    elif DEV.type == "cpu":  # the interpreter rounds products and sum as torch does
        assert torch.equal(got, ref)
    else:  # compiled for a GPU, the half-type sum may round once differently (measured on an H100)
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 4, 2, 16), (6, 9, 3, 64), (3, 2, 1, 128)])
def test_rope_store_kv_is_rope_then_the_pool_write(tokens, heads, kv_heads, dim, dtype):
    """One launch: the queries rotated, the keys rotated and the values copied into the
    cache rows of the tokens' slots, exactly as apply_rope followed by the pool's index
    write; the other rows untouched."""
    rot = RotaryEmbedding(dim, 256, 10000.0, None)
    rot.build(DEV, dtype)
    cos, sin = rot.lookup(torch.randint(0, 256, (tokens,), device=DEV))
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, device=DEV).to(dtype)
    slots = torch.tensor([5, 0, 3, 2, 7, 1][:tokens], device=DEV)
    k_cache, v_cache = (torch.randn(8, kv_heads, dim, device=DEV).to(dtype) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    with kernels.fused_kernels(True):
        q = kernels.rope_store_kv(qkv, heads, cos, sin, k_cache, v_cache, slots)
        qk = apply_rope(qkv[:, :heads + kv_heads], cos, sin)
    k_ref[slots], v_ref[slots] = qk[:, heads:], qkv[:, heads + kv_heads:]  # KVPool.write
    assert torch.equal(v_cache, v_ref)
    for got, ref in ((q, qk[:, :heads]), (k_cache, k_ref)):
        if dtype == torch.float32 and DEV.type == "cuda":  # either kernel's sum may be an FMA
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        elif DEV.type == "cuda":  # compiled, either half-type sum may round once differently (H100: 128 dims)
            torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)
        else:
            assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,dim,k,norm", [(2, 4, 2, 16, 64, True), (6, 9, 3, 64, 576, True),
                                                             (23, 9, 3, 64, 576, True), (5, 2, 1, 128, 1100, False),
                                                             (17, 2, 1, 32, 1100, True)])
@pytest.mark.parametrize("split", [1, 3])
def test_qkv_rope_store_is_the_projection_then_rope_store_kv(tokens, heads, kv_heads, dim, k, norm, split, dtype,
                                                             monkeypatch):
    """One launch (qkv_rope.py) against its two: the few-token projection (with the exact
    norm, the deferred one, or none; one K tile or several; K split over 3 programs or
    not) and then rope_store_kv on the gathered tables (the kernel reads the table's rows
    at the positions itself); the cache rows of other slots untouched."""
    from specserve.kernels import qkv_rope

    _force_split(monkeypatch, qkv_rope, split)  # the reference's projection unsplit

    rot = RotaryEmbedding(dim, 256, 10000.0, None)
    rot.build(DEV, dtype)
    rope = rot.at(torch.randint(0, 256, (tokens,), device=DEV))
    x = torch.randn(tokens, k, device=DEV).to(dtype)
    w = torch.randn((heads + 2 * kv_heads) * dim, k, device=DEV).div(k ** 0.5).to(dtype)
    nw = _norm(k, dtype).weight if norm else None
    slots = torch.randperm(40, device=DEV)[:tokens]
    caches = [torch.randn(40, kv_heads, dim, device=DEV).to(dtype) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    with kernels.fused_kernels(True), torch.no_grad():
        q = qkv_rope.qkv_rope_store(x, w, heads, rope, *caches, slots, norm_weight=nw, eps=1e-6)
        qkv = kernels.gemv(x, w, norm_weight=nw, eps=1e-6).view(tokens, -1, dim)
        q_ref = kernels.rope_store_kv(qkv, heads, *rope.tables(), *ref_caches, slots)
    for got, ref in zip([q, *caches], [q_ref, *ref_caches]):  # another row tiling may sum the dot differently
        _close(got, ref, 2e-2)


@pytest.mark.parametrize("tokens,norm", [(6, True), (20, False)])
def test_qkv_rope_store_on_float32_tiles(tokens, norm, monkeypatch):
    """The fused qkv + RoPE + KV write on a GPU's float32 launch shapes (f32_config for
    132 SMs: K split 5 ways at 576 columns, 2 warps) against the projection on the
    interpreter's tiles, then rope_store_kv."""
    from specserve.kernels import qkv_rope

    gpu_float32_tiles(monkeypatch, qkv_rope)
    heads, kv_heads, dim, k = 9, 3, 64, 576
    rot = RotaryEmbedding(dim, 256, 10000.0, None)
    rot.build(DEV, torch.float32)
    rope = rot.at(torch.randint(0, 256, (tokens,), device=DEV))
    x = torch.randn(tokens, k, device=DEV)
    w = torch.randn((heads + 2 * kv_heads) * dim, k, device=DEV).div(k ** 0.5)
    nw = _norm(k, torch.float32).weight if norm else None
    slots = torch.randperm(40, device=DEV)[:tokens]
    caches = [torch.randn(40, kv_heads, dim, device=DEV) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    with kernels.fused_kernels(True), torch.no_grad():
        q = qkv_rope.qkv_rope_store(x, w, heads, rope, *caches, slots, norm_weight=nw, eps=1e-6)
        qkv = kernels.gemv(x, w, norm_weight=nw, eps=1e-6).view(tokens, -1, dim)
        q_ref = kernels.rope_store_kv(qkv, heads, *rope.tables(), *ref_caches, slots)
    for got, ref in zip([q, *caches], [q_ref, *ref_caches]):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


def _logits(model, fused: bool) -> list[torch.Tensor]:
    """Logits of a 9-token extend, then of a 1-token decode."""
    with kernels.fused_kernels(fused):
        r = BareRunner(model)
        ids = [5, 17, 99, 3, 250, 7, 1, 42, 8]
        prefill = r.forward([0], [0], [ids])
        decode = r.forward([0], [len(ids)], [[77]], mode=ForwardMode.DECODE)
    return [prefill, decode]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 5])
def test_a_bias_rides_on_the_gemv_as_a_broadcast_residual(t, dtype):
    """Qwen2's q/k/v bias on the few-token path: the bias broadcast over the tokens as the
    GEMV's residual (a row stride of 0, no copy), after the pre-norm, is the norm, then
    F.linear, then the bias added (the rounding of the residual add)."""
    n, k = 96, 576
    x = torch.randn(t, k, device=DEV).to(dtype)
    w = torch.randn(n, k, device=DEV).div(k ** 0.5).to(dtype)
    bias, norm = torch.randn(n, device=DEV).to(dtype), _norm(k, dtype)
    got = kernels.gemv(x, w, norm_weight=norm.weight, eps=norm.eps, residual=bias.expand(t, n))
    with kernels.fused_kernels(False), torch.no_grad():
        ref = bias + F.linear(norm(x), w)
    _close(got, ref)


@pytest.mark.parametrize("kind,skinny", [("llama", False), ("qwen3", False), ("llama", True), ("qwen2", True),
                                         ("qwen2", False)])
def test_tiny_model_fused_matches_torch(tmp_path, kind, skinny, monkeypatch):
    """skinny: the 9-token extend runs the few-token layers too (the default; without,
    SPECSERVE_SKINNY=0, it runs the separate norms and F.linear). qwen2: a q/k/v bias, on
    the few-token layers as the qkv GEMV's broadcast residual."""
    monkeypatch.setenv("SPECSERVE_SKINNY", "1" if skinny else "0")
    model = load_model(save_tiny_hf(kind, tmp_path / kind), torch.float32, DEV)
    model.aux_layers = (0, 1, 2)  # exercises the residual-stream capture too
    for got, ref in zip(_logits(model, True), _logits(model, False)):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def _eagle3_logits(draft, features: torch.Tensor) -> torch.Tensor:
    """The head's float32 logits over a 5-token extend fed `features`, then over a
    1-token step fed its own last hidden (a fresh KV pool and table each call)."""
    from specserve.attention.torch_ref import TorchRefBackend
    from specserve.cache.kv_pool import KVPool
    from specserve.cache.req_table import ReqToTokenTable
    from specserve.core.forward_batch import ForwardBatch

    cfg = draft.config
    pool = KVPool(64, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, DEV)
    table, backend, logits = ReqToTokenTable(2, 64, DEV), TorchRefBackend(), []
    for prefix, tokens, mode in ((0, [7, 300, 41, 5, 99], ForwardMode.DRAFT_EXTEND), (5, [12], ForwardMode.DECODE)):
        n = len(tokens)
        slots = torch.arange(1 + prefix, 1 + prefix + n, device=DEV)
        table.write(0, prefix, slots)
        fb = ForwardBatch(mode, torch.tensor(tokens, device=DEV), torch.arange(prefix, prefix + n, device=DEV),
                          slots, torch.tensor([0], device=DEV), [prefix], [n], table.table, pool, backend,
                          logit_rows=torch.arange(n, device=DEV))
        backend.init_forward_metadata(fb)
        h_logits, features = draft(fb, features)
        logits.append(draft.compute_logits(h_logits))
        features = features[-1:]
    return torch.cat(logits)


def test_eagle3_head_fused_matches_torch(tmp_path):
    """A drafting depth of a few rows runs the EAGLE-3 midlayer on the few-token kernels
    (o_proj and down_proj add the residual, gate_up takes the post-attention norm and the
    SiLU*mul) and the draft head's logits come from the GEMV: the torch path's logits."""
    from specserve.models.draft_layouts import save_eagle3
    from specserve.models.draft_loader import load_draft

    path = save_tiny_hf("llama", tmp_path / "t")
    target = load_model(path, torch.float32, DEV)
    draft = load_draft(save_eagle3(tmp_path / "e3", path, draft_vocab=96, aux_ids=[-1, 0, 1]), target,
                       LAYOUTS["EAGLE3"], torch.float32, DEV)
    features = torch.randn(5, 3 * target.config.hidden_size, device=DEV)
    got, ref = _both(lambda: _eagle3_logits(draft, features))
    assert got.shape == (6, 96)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_aux_states_fused_match_torch(tmp_path):
    from specserve.core.forward_batch import ForwardBatch

    model = load_model(save_tiny_hf("llama", tmp_path / "m"), torch.float32, DEV)
    model.aux_layers = (0, 1, 2)
    outs = []
    for fused in (True, False):
        with kernels.fused_kernels(fused):
            r = BareRunner(model)
            ids = torch.tensor([5, 17, 99, 3])
            r.table.write(0, 0, r.slots(4))
            fb = ForwardBatch(ForwardMode.EXTEND, ids.to(DEV), torch.arange(4, device=DEV),
                              torch.arange(1, 5, device=DEV), torch.tensor([0], device=DEV), [0], [4],
                              r.table.table, r.pool, r.backend, logit_rows=torch.arange(4, device=DEV))
            r.backend.init_forward_metadata(fb)
            with torch.inference_mode():
                outs.append(model(fb))
    (h, aux), (h0, aux0) = outs
    torch.testing.assert_close(h, h0, rtol=1e-5, atol=1e-5)
    assert torch.equal(aux[0], aux0[0])  # the embeddings, untouched
    for a, b in zip(aux[1:], aux0[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_kernel_is_the_lookup(dtype):
    """The model's embedding through one gather launch: the rows nn.Embedding gives, for
    int32 and int64 ids with repeats; an id outside the vocabulary gives a zero row."""
    from specserve.models.layers import Embedding

    torch.manual_seed(0)
    emb = Embedding(50, 24).to(DEV, dtype)
    for ids in (torch.tensor([3, 49, 0, 3, 17], device=DEV), torch.tensor([7], dtype=torch.int32, device=DEV)):
        with torch.inference_mode():
            got, ref = _both(lambda: emb(ids))
        assert got.dtype == dtype and torch.equal(got, ref)
    with kernels.fused_kernels(True), torch.inference_mode():
        out = emb(torch.tensor([2, 50, -1], device=DEV))
    assert torch.equal(out[0], emb.weight[2]) and not out[1:].any()
