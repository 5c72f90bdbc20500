"""The fused Triton kernels (specserve.kernels) against the torch path they replace.

On CUDA the kernels run compiled; on CPU under TRITON_INTERPRET=1 (set before triton is
first imported). Half types: bf16 on CUDA only, since the interpreter casts fp32 -> bf16
by truncation rather than round-to-nearest (checked: results differ by 1 bf16 ulp); fp16
everywhere, where the interpreter rounds correctly and the kernels match torch exactly.
Each check flips `fused_kernels(True/False)` around the same module call, so the
reference is the very code path CPU inference runs.
"""
from __future__ import annotations

import itertools

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from specserve import kernels  # noqa: E402
from specserve.models.layers import RMSNorm  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402
from specserve.models.rope import RotaryEmbedding, apply_rope  # noqa: E402
from specserve.runner.forward_batch import ForwardMode  # noqa: E402
from tests.unit.model_utils import BareRunner, save_tiny_hf  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV.type == "cuda" else [])


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if ref.dtype == torch.float32:  # reduction order differs: a few ulp
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:  # one half-type ulp at most (fp32 rsqrt/exp differ by ulps before rounding)
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)


def _both(fn):
    """(fused result, torch result) of fn()."""
    with kernels.fused_kernels(True), torch.no_grad():
        got = fn()
    with kernels.fused_kernels(False), torch.no_grad():
        ref = fn()
    return got, ref


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
def test_rms_norm_pair_is_two_norms_and_a_cat(tokens, n, dtype):
    """EAGLE-3's midlayer input, cat(norm(embeds), norm(hidden)), in one launch; the
    hidden may be a row slice of a wider tensor."""
    a, ma, mb = torch.randn(tokens, n, device=DEV).to(dtype), _norm(n, dtype), _norm(n, dtype)
    b = torch.randn(tokens, 2 * n, device=DEV).to(dtype)[:, n:]
    got = kernels.rms_norm_pair(a, ma.weight, b, mb.weight, ma.eps)
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
    _close(kernels.gemv(x, w, norm_weight=norm.weight, eps=norm.eps), F.linear(normed, w))
    _close(kernels.gemv(x, w, residual=res), res + F.linear(x, w))
    gate, up = F.linear(normed, wg).chunk(2, dim=-1)
    _close(kernels.gemv(x, wg, norm_weight=norm.weight, eps=norm.eps, gated=True), F.silu(gate) * up)


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


def test_skinny_config_fits_the_device(monkeypatch):
    """Llama-8B's and SmolLM2's layers, half and float32 weights, 16 and 32 padded tokens,
    with and without the norm: every stage (weight tile or gated pair, x tile) fits an
    H100's 227 KB with at least one stage; a looped layer that is narrow gets BLOCK_N down
    to 16 before it runs on few programs (an H100 refused 4 stages of gate_up's pair, and
    ran SmolLM2's layers on 9 programs); one tile is taken for rows up to 1024 wide only,
    never gated, and never for 32 normed tokens (their fp32 x tile spills registers)."""
    from specserve.kernels import skinny

    budget, sms = 227 * 1024 - 8 * 1024, 132
    monkeypatch.setattr(skinny, "_device_limits", lambda device: (budget, sms))
    shapes = [(6144, 4096, False), (4096, 4096, False), (14336, 4096, True), (4096, 14336, False),
              (128256, 4096, False), (960, 576, False), (576, 576, False), (1536, 576, True), (576, 1536, False),
              (49152, 576, False)]
    for (n, k, gated), w_bytes, block_t, norm in itertools.product(shapes, (2, 4), (16, 32), (False, True)):
        block_n, block_k, stages = skinny._config(n, k, gated, norm, w_bytes, block_t, DEV)
        assert 1 <= stages <= 4 and 16 <= block_k, (n, k, block_k, stages)
        assert stages * ((2 if gated else 1) * block_n + block_t) * block_k * w_bytes <= budget, (n, k, w_bytes)
        if block_k >= k:  # one tile
            assert stages == 1 and k <= 1024 and n < 16384 and not gated and not (norm and block_t == 32), (n, k, norm)
        else:
            assert block_n == 16 or -(-n // block_n) >= sms // 2, (n, block_n)
    assert skinny._config(576, 576, False, False, 2, 16, DEV)[1:] == (1024, 1)  # o_proj: one tile
    assert skinny._config(576, 1536, False, False, 2, 16, DEV)[0] == 16  # down_proj: 36 programs, not 9


def test_few_token_path_takes_narrow_models_only(monkeypatch):
    """One token always; 2-32 tokens up to 2048 wide (Llama-8B's 4096-wide verify was
    faster on cuBLAS), unless SPECSERVE_SKINNY=0."""
    def takes(t: int, width: int) -> bool:
        with kernels.fused_kernels(True):
            return kernels.use_gemv(torch.zeros(t, width))

    assert takes(1, 4096) and takes(32, 576) and takes(2, 2048)
    assert not takes(16, 4096) and not takes(33, 576)
    monkeypatch.setenv("SPECSERVE_SKINNY", "0")
    assert takes(1, 576) and not takes(16, 576)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n,k", [(2, 7, 64), (16, 96, 576), (23, 33, 300)])  # tokens padded to 16 / 32
def test_skinny_is_the_unfused_chain(t, n, k, dtype):
    """The few-token kernel (skinny.py) against the same torch ops, per token."""
    x = torch.randn(t, k, device=DEV).to(dtype)
    res = torch.randn(t, n, device=DEV).to(dtype)
    w, wg = (torch.randn(rows, k, device=DEV).div(k ** 0.5).to(dtype) for rows in (n, 2 * n))
    _check_fused_forms(x, w, wg, res, _norm(k, dtype))
    _close(kernels.gemv(x, w.t().contiguous().t()), F.linear(x, w))  # the CPU's [in, out] layout


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
        else:
            assert torch.equal(got, ref)


def _logits(model, fused: bool) -> list[torch.Tensor]:
    """Logits of a 9-token extend, then of a 1-token decode."""
    with kernels.fused_kernels(fused):
        r = BareRunner(model)
        ids = [5, 17, 99, 3, 250, 7, 1, 42, 8]
        prefill = r.forward([0], [0], [ids])
        decode = r.forward([0], [len(ids)], [[77]], mode=ForwardMode.DECODE)
    return [prefill, decode]


@pytest.mark.parametrize("kind,skinny", [("llama", False), ("qwen3", False), ("llama", True)])
def test_tiny_model_fused_matches_torch(tmp_path, kind, skinny, monkeypatch):
    """skinny: the 9-token extend runs the few-token layers too (the default; without,
    SPECSERVE_SKINNY=0, it runs the separate norms and F.linear)."""
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
    from specserve.runner.forward_batch import ForwardBatch

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
                       "EAGLE3", torch.float32, DEV)
    features = torch.randn(5, 3 * target.config.hidden_size, device=DEV)
    got, ref = _both(lambda: _eagle3_logits(draft, features))
    assert got.shape == (6, 96)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_aux_states_fused_match_torch(tmp_path):
    from specserve.runner.forward_batch import ForwardBatch

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,vocab,k", [(1, 16384, 4), (6, 1000, 8), (3, 77, 1), (2, 32768, 2)])
@pytest.mark.parametrize("mapped", [False, True])
def test_topk_logprobs_is_the_tree_drafters_torch_path(rows, vocab, k, mapped, dtype):
    """One launch gives what top_children's torch path gives: the k best entries in
    descending order, their log-softmax values, their ids through the draft vocabulary's
    map (random logits: no ties)."""
    from specserve.spec.tree_draft import top_children

    torch.manual_seed(vocab + k)
    logits = (4 * torch.randn(rows, vocab, device=DEV)).to(dtype)
    token_map = torch.randperm(5 * vocab, device=DEV)[:vocab] if mapped else None
    (logp, ids), (logp0, ids0) = _both(lambda: top_children(logits, k, token_map))
    torch.testing.assert_close(logp, logp0, rtol=1e-5, atol=1e-5)
    assert logp.dtype == torch.float32 and bool((logp[:, :-1] >= logp[:, 1:]).all())
    assert ids.dtype == torch.int64
    if dtype == torch.float32:  # no ties
        assert torch.equal(ids, ids0)
    else:  # fp16 rounds some logits together: a tie may come in either order, but each
        # id is a distinct entry carrying its value
        where = torch.arange(vocab, device=DEV) if token_map is None else \
            torch.full((5 * vocab,), -1, device=DEV).index_put_((token_map,), torch.arange(vocab, device=DEV))
        pos = where[ids]
        assert all(len(set(row)) == k for row in pos.tolist())
        torch.testing.assert_close(logits.float().gather(1, pos), logits.float().gather(1, where[ids0]))


def test_topk_logprobs_leaves_long_rows_to_torch():
    assert kernels.topk_logprobs(torch.zeros(1, 40000, device=DEV), 4) is None


@pytest.mark.parametrize("bsz,k,steps,hidden", [(1, 4, 5, 8), (3, 2, 4, 0), (2, 4, 2, 16), (2, 1, 3, 4), (2, 4, 1, 8)])
def test_tree_expansion_fused_is_the_torch_path(bsz, k, steps, hidden):
    """A whole drafting pass (TreeDrafter.expand) with the fused per-depth kernels (top-k
    children, frontier bookkeeping) against the torch ops they replace: every draft forward
    sees the same frontier (tokens, positions, tails of ancestor slots, branch states) and
    the trees are the same. The draft is a random function of all of those."""
    from specserve.spec.tree_draft import TreeDrafter, TreeInputs

    vocab = 50
    g = torch.Generator().manual_seed(bsz * 100 + k * 10 + steps)
    emb, pos_w, slot_w = (torch.randn(n, vocab, generator=g).to(DEV) for n in (vocab, 64, 512))
    state_w = torch.randn(max(hidden, 1), vocab, generator=g).to(DEV)
    first_logp = torch.randn(bsz, k, generator=g).sort(dim=1, descending=True).values.to(DEV) - 1
    first_ids = torch.randint(0, vocab, (bsz, k), generator=g).to(DEV)
    states = torch.randn(bsz, hidden, generator=g).to(DEV) if hidden else None
    scratch = (torch.randperm(500, generator=g)[:(steps - 1) * bsz * k] + 1).view(steps - 1, bsz * k).to(DEV)
    x = TreeInputs(first_logp, first_ids, states, torch.arange(bsz, device=DEV), torch.arange(bsz, device=DEV),
                   torch.randint(0, 30, (bsz,), generator=g).to(DEV), scratch)

    def run(fused: bool):
        seen = []

        def step(frame, st):
            seen.append((frame.ids.tolist(), frame.positions.tolist(), frame.tail.tolist(),
                         None if st is None else st.tolist()))
            logits = emb[frame.ids] + pos_w[frame.positions] + slot_w[frame.tail].sum(1)
            if st is not None:
                logits = logits + st @ state_w
                st = torch.tanh(st + emb[frame.ids][:, :hidden])
            return 3 * logits, st

        with kernels.fused_kernels(fused), torch.no_grad():
            tokens, parents, mask = TreeDrafter(None, None, k, steps).expand(x, step, 1 + k + (steps - 1) * k)
        return tokens.tolist(), parents.tolist(), mask.tolist(), seen

    assert run(True) == run(False)  # the trees and their masks, then the frames each forward saw


@pytest.mark.parametrize("width", [1, 1000, 4096 + 17])
def test_gumbel_noise_is_the_samplers_hash(width):
    """The kernel's noise is the torch path's -log(-log(uniform_noise)): same hash (large
    seeds use their high 32 bits too), logs equal to float32 rounding; and the sampler
    and speculative verification draw the same noise through it."""
    from specserve.runner.sampler import gumbel_noise, uniform_noise

    seeds = torch.tensor([0, 7, 2**40 + 3, 2**63 - 1, 7], device=DEV)
    counters = torch.tensor([0, 5, 5, 2**31 + 9, 6], device=DEV)
    got, ref = _both(lambda: gumbel_noise(seeds, counters, width))
    assert got.shape == (5, width) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(ref, -torch.log(-torch.log(uniform_noise(seeds, counters, width))))
    assert not torch.equal(got[1], got[4])  # the counter moves the noise
    if width > 1:
        assert not torch.equal(got[1], got[2])  # and so does the seed
    u = torch.exp(-torch.exp(-got.double()))  # back to the uniforms: (0, 1), about mean 1/2
    assert 0 < float(u.min()) and float(u.max()) < 1
    if width >= 1000:
        assert abs(float(u.mean()) - 0.5) < 0.02


def _random_trees(bsz: int, n: int, vocab: int, seed: int):
    """Ragged random trees over a tiny vocabulary (so siblings repeat tokens and many
    nodes hit) and logits that favour drafted tokens."""
    import random

    from specserve.spec.drafts import Drafts

    rng = random.Random(seed)
    tokens, parents = [], []
    for b in range(bsz):
        size = n if b % 2 == 0 else rng.randint(1, n)  # odd rows ragged: padded to n
        parents.append([-1] + [rng.randrange(i) for i in range(1, size)])
        tokens.append([rng.randrange(vocab) for _ in range(size)])
    drafts = Drafts.from_lists(tokens, parents)
    logits = torch.randn(bsz, n, vocab, generator=torch.Generator().manual_seed(seed))
    return Drafts(drafts.tokens.to(DEV), drafts.parents.to(DEV), drafts.valid.to(DEV), drafts.counts), logits.to(DEV)


@pytest.mark.parametrize("n", [1, 4, 9, 33])
@pytest.mark.parametrize("rows", [None, [0, 2, 3]])
@pytest.mark.parametrize("chunk", [4096, 2])
def test_greedy_walk_kernel_is_the_accept_walk(n, rows, chunk, monkeypatch):
    """kernels/walk.py against _accept_greedy's torch path: the same paths, committed tokens
    and the same GreedyWalk handed to drafting ahead (on-path nodes, tokens, bonus). With
    2-logit chunks the argmax is reduced over 2 or 3 chunks by the walk."""
    from specserve.kernels import walk
    from specserve.spec.accept import _accept_greedy

    monkeypatch.setattr(walk, "CHUNK", chunk)

    deepest = 1
    for seed in range(6):
        drafts, logits = _random_trees(5, n, 3 if seed % 2 else 6, seed)
        walks = []

        def run():
            out = _accept_greedy(drafts, logits, rows, before_read=walks.append)
            w = walks[-1]
            return out, (w.on_path.cpu(), w.tokens.cpu(), w.bonus.cpu())

        (got, got_walk), (ref, ref_walk) = _both(run)
        assert got == ref, (seed, got, ref)
        for a, b in zip(got_walk, ref_walk):
            assert torch.equal(a, b)
        deepest = max([deepest] + [len(p) for p in ref[0]])
    assert deepest >= min(n, 3)  # paths of accepted drafts were walked, not only roots


@pytest.mark.parametrize("bsz,k,steps,n_sel", [(1, 4, 5, 15), (2, 8, 5, 31), (3, 8, 8, 63), (2, 4, 6, 1)])
def test_tree_select_is_the_torch_path(bsz, k, steps, n_sel):
    """The end of a drafting pass in one launch: the kept candidates renumbered as nodes,
    parents remapped (a parent that was not kept hands its child to the root), and the
    ancestor masks, against the torch ops (top-k, sort, scatter, gathers, squarings).
    Candidates are laid out as a pass lays them out (depth-major, k*k children per depth,
    a child scored below its parent, the best k children the next frontier); every first
    child costs little, so the deepest candidates are kept too. 264 and 456 candidates
    take several ranking chunks."""
    from specserve.spec.tree_draft import _select

    g = torch.Generator().manual_seed(bsz * 1000 + k * 10 + steps)
    scores = [-torch.rand(bsz, k, generator=g)]
    parents = [torch.full((bsz, k), -1, dtype=torch.int64)]
    size, frontier = k, torch.arange(k).repeat(bsz, 1)
    for _ in range(1, steps):
        par = frontier.repeat_interleave(k, dim=1)  # [B, k*k]: each frontier node's k children
        cost = torch.rand(bsz, k * k, generator=g) * torch.where(torch.arange(k * k) % k == 0, 1e-3, 1.0)
        scores.append(torch.cat(scores, 1).gather(1, par) - cost)
        parents.append(par)
        frontier = size + scores[-1].topk(k, dim=1).indices
        size += k * k
    scores, parents = torch.cat(scores, 1).to(DEV), torch.cat(parents, 1).to(DEV)
    tokens = torch.randint(0, 1000, scores.shape, generator=g).to(DEV)
    roots = torch.arange(bsz, device=DEV) + 7
    assert scores.shape[1] > n_sel
    got, ref = _both(lambda: _select(roots, scores, tokens, parents, n_sel, steps))
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert ref[2].shape == (bsz, n_sel + 1, n_sel + 1) and ref[2].any(2).all()


def test_tree_select_ties_go_to_the_lower_candidate():
    """Equal scores: the lower candidate index is kept (a parent always beats a tied
    child, so kept sets are ancestor-closed)."""
    from specserve.kernels.node_select import tree_select

    scores = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -1.0]], device=DEV)
    tokens = torch.tensor([[10, 11, 12, 13, 14]], device=DEV)
    parents = torch.tensor([[-1, -1, -1, -1, 0]], device=DEV)
    with torch.no_grad():
        got = tree_select(torch.tensor([5], device=DEV), scores, tokens, parents, 2, 2)
    assert got[0].tolist() == [[5, 10, 11]] and got[1].tolist() == [[-1, 0, 0]]
    assert got[2].tolist() == [[[True, False, False], [True, True, False], [True, False, True]]]


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
