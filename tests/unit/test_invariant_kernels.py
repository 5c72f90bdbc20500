"""--enable-deterministic-inference's kernels are batch-invariant, bit for bit, in bf16.

Compiled on CUDA, under TRITON_INTERPRET=1 on a CPU. For each kernel the mode runs:
row i of a call over M rows equals the call over that row alone, over a sweep of M and
shapes (the linear layer, the norms, SiLU*mul, RoPE + KV write, the embedding); and the
attention of a token is the same bits as a decode (alone or batched), as a row of a
prefill (whole or chunked), as a node of a verified tree (siblings masked in between)
and after a draft tail. Their values are also checked against torch, loosely.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.unit.triton_interp import DEV  # first: sets TRITON_INTERPRET on CPU (and widens bf16 dots)

pytest.importorskip("triton")

from specserve import kernels  # noqa: E402
from specserve.attention import triton_invariant  # noqa: E402
from specserve.attention.torch_ref import TorchRefBackend  # noqa: E402
from specserve.attention.triton_backend import InvariantTritonBackend  # noqa: E402
from specserve.cache.kv_pool import KVPool  # noqa: E402
from specserve.core.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from specserve.kernels import invariant_mm  # noqa: E402
from specserve.models import invariant  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402
from tests.unit.model_utils import BareRunner, save_tiny_hf  # noqa: E402

BF16 = torch.bfloat16
ROWS = (1, 2, 5, 16, 17, 33)


def _rows_alone(fn, m: int) -> None:
    """fn(idx) (the rows idx of its inputs) over rows 0..m-1 equals fn over its first,
    middle and last rows alone, bit for bit."""
    with torch.no_grad():
        whole = fn(torch.arange(m, device=DEV))
        for i in sorted({0, m // 2, m - 1}):
            assert torch.equal(fn(torch.tensor([i], device=DEV))[0], whole[i]), (m, i)


@pytest.mark.parametrize("n, k, bias, rows", [(40, 48, False, ROWS), (70, 200, True, ROWS),
                                              (24, 1100, False, (1, 17))])  # K tiles of 256 and a tail
def test_linear_rows_do_not_depend_on_the_row_count(n, k, bias, rows):
    g = torch.Generator().manual_seed(n)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEV, BF16)
    b = torch.randn(n, generator=g).to(DEV, BF16) if bias else None
    x = torch.randn(max(rows), k, generator=g).to(DEV, BF16)
    for m in rows:
        _rows_alone(lambda idx: kernels.invariant_matmul(x[idx], w, b), m)
    got = kernels.invariant_matmul(x, w, b, out_dtype=torch.float32)
    ref = x.float() @ w.float().T + (b.float() if bias else 0)
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("method, group, offset, dtype", [("q4", 32, True, BF16), ("q4", 128, True, BF16),
                                                        ("q8", 32, False, torch.float16), ("q8", 16, False, BF16)])
def test_quantized_blocks_rows_do_not_depend_on_the_row_count(method, group, offset, dtype):
    """A GPU's GGUF blocks (and AWQ/GPTQ groups held as q4) in the mode: `invariant_linear`
    over them (`kernels.invariant_blocks`, the bias added after) gives each row the bits of
    that row alone, at row counts where the fast path would change kernels (1-2: int16 dot
    products, 3-32: tensor cores, more: the dot kernel), and the blocks' values."""
    from specserve.models.layers import invariant_linear
    from tests.unit.test_blocks_kernel import _blocks

    qw = _blocks(method, 40, 256, group, offset, seed=group)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(33, 256, generator=g).to(DEV, dtype)
    b = torch.randn(40, generator=g).to(DEV, dtype)
    for m in (1, 3, 5, 33):
        _rows_alone(lambda idx: invariant_linear(x[idx], qw, None, b), m)
    got = invariant_linear(x, qw, None, None, torch.float32)
    ref = x.float() @ qw.dequantize(torch.float32).T
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    assert kernels.invariant_quantized_serve(qw, dtype) == qw.data.is_cuda  # the mode's check: blocks on a GPU
    assert not kernels.invariant_quantized_serve(qw, torch.float32)


@pytest.mark.parametrize("group, gated, dtype", [(None, False, BF16), (None, True, torch.float16), (32, False, BF16),
                                                (64, True, BF16)])
def test_fp8_rows_do_not_depend_on_the_row_count(group, gated, dtype):
    """fp8 weights in the mode (`invariant_linear` -> invariant_mm.py): one scale a row or
    one every `group` columns (a K tail included), the tiles widened to x's dtype exactly
    and scaled in fp32; gate_up's SiLU*mul; each row the bits of that row alone, and the
    values those of the dequantized weight."""
    from specserve.core import quant
    from specserve.models.layers import invariant_linear

    g = torch.Generator().manual_seed(7)
    n, k = 48, 200
    w = torch.randn(2 * n if gated else n, k, generator=g) / k ** 0.5
    data, scale = quant.quantize_fp8(w, group)
    qw = quant.QuantWeight(data.to(DEV), scale.to(DEV), group or k)
    assert kernels.invariant_quantized_serve(qw, dtype) == qw.data.is_cuda  # the mode's check: on a GPU
    assert not kernels.invariant_quantized_serve(qw, torch.float32)  # half activations only
    x = torch.randn(33, k, generator=g).to(DEV, dtype)
    if gated:
        fn = lambda idx: kernels.invariant_matmul(x[idx], qw.data, gated=True, scale=qw)  # noqa: E731
    else:
        fn = lambda idx: invariant_linear(x[idx], qw, None, None)  # noqa: E731
    for m in (1, 5, 33):
        _rows_alone(fn, m)
    ref = x.float() @ qw.dequantize(torch.float32).T
    if gated:
        ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
    torch.testing.assert_close(fn(torch.arange(33, device=DEV)).float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("n, k", [(40, 48), (70, 200)])
def test_the_fused_epilogues_keep_rows_alone_and_their_values(n, k):
    """The norm (weight folded in, 1/rms from partial sums of squares), silu(gate) * up and
    residual (+ sums of squares) epilogues: rows equal one-row calls; SiLU*mul and the
    residual add equal their separate launches bit for bit; the norm (another arithmetic:
    the weight folded, the scale after the products) and the partial sums closely."""
    g = torch.Generator().manual_seed(k)
    w = (torch.randn(2 * n, k, generator=g) / k ** 0.5).to(DEV, BF16)
    x, r = torch.randn(max(ROWS), k, generator=g).to(DEV, BF16), torch.randn(max(ROWS), n, generator=g).to(DEV, BF16)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(DEV, BF16)
    folded = (w[:n].float() * nw.float()).to(BF16)
    ss = kernels.row_sumsq(x)
    assert ss.shape == (max(ROWS), -(-k // 32))
    torch.testing.assert_close(ss.sum(1), x.float().square().sum(1))

    def normed(idx):
        return kernels.invariant_matmul(x[idx], folded, norm=(1e-5, kernels.row_sumsq(x[idx])))

    def gated(idx):
        return kernels.invariant_matmul(x[idx], w, gated=True)

    def added(idx):
        return torch.cat([t.float() for t in kernels.invariant_matmul(x[idx], w[:n], residual=r[idx], sumsq=True)], 1)
    for m in ROWS:
        for fn in (normed, gated, added):
            _rows_alone(fn, m)
    torch.testing.assert_close(normed(slice(None)), kernels.invariant_matmul(kernels.rms_norm(x, nw, 1e-5), w[:n]),
                               rtol=2e-2, atol=2e-2)
    assert torch.equal(gated(slice(None)), kernels.silu_and_mul(kernels.invariant_matmul(x, w)))
    wide = torch.randn(2 * 8192, k, generator=g).to(DEV, BF16) / k ** 0.5  # 64-row tiles, gated or not
    assert torch.equal(kernels.invariant_matmul(x[:2], wide, gated=True),
                       kernels.silu_and_mul(kernels.invariant_matmul(x[:2], wide)))
    y, ss_y = kernels.invariant_matmul(x, w[:n], residual=r, sumsq=True)
    assert torch.equal(y, kernels.fused_add_rms_norm(kernels.invariant_matmul(x, w[:n]), r, r[0], 1e-5)[1])
    assert ss_y.shape == (max(ROWS), -(-n // 32))
    torch.testing.assert_close(ss_y.sum(1), y.float().square().sum(1))


@pytest.mark.parametrize("form", ["plain", "gated", "normed", "residual", "fp8_rows", "fp8_groups"])
def test_a_split_k_is_the_same_bits_as_one_program_walking_it(form, monkeypatch):
    """A narrow weight's K splits (`split_k`: fixed by the weight) are summed the same
    way whether each split has a program of its own (a few rows, the last to arrive adding the
    stored sums) or one program walks them all (more rows): the same rows, bit for bit,
    in every epilogue, with fp8 scales a row and a group; and the two-launch count leaves 0s."""
    from specserve.core import quant
    from specserve.kernels.skinny_config import counts

    g = torch.Generator().manual_seed(11)
    n, k, m = 40, 520, 12  # 5 K tiles of 128 (a tail of 8), two output tiles
    w = torch.randn(2 * n if form == "gated" else n, k, generator=g) / k ** 0.5
    x, r = torch.randn(m, k, generator=g).to(DEV, BF16), torch.randn(m, n, generator=g).to(DEV, BF16)
    scale = None
    if form.startswith("fp8"):
        data, s = quant.quantize_fp8(w, 64 if form == "fp8_groups" else None)
        scale = quant.QuantWeight(data.to(DEV), s.to(DEV), 64 if form == "fp8_groups" else k)
        w = scale.data
    else:
        w = w.to(DEV, BF16)
    fused = {"gated": {"gated": True}, "normed": {"norm": (1e-5, kernels.row_sumsq(x))},
             "residual": {"residual": r, "sumsq": True}}.get(form, {})
    assert invariant_mm.split_k(n, k, 32)

    out_dtype = torch.float32 if form in ("plain", "fp8_rows", "fp8_groups") else None  # the head's fp32 logits

    def run() -> torch.Tensor:
        y = invariant_mm.invariant_matmul(x, w, scale=scale, out_dtype=out_dtype, **fused)
        return torch.cat([t.float() for t in y], 1) if isinstance(y, tuple) else y

    split = run()
    monkeypatch.setattr(invariant_mm, "SPLIT_ROWS", 0)  # one program walks all of K
    assert torch.equal(run(), split)
    assert not counts(x.device).any()


def test_short_rows_are_prefetched_in_few_row_calls_only():
    """`prefetch_rule`: a walking program of a call of at most SPLIT_ROWS rows asks L2 for
    weight rows shorter than PREFETCH_K (a line is 64 bf16 or 128 fp8 elements); not for
    long rows, an lm_head, a split weight, a longer call or a weight that is not contiguous."""
    rule, plan = invariant_mm.prefetch_rule, invariant_mm.plan
    assert rule((960, 576), (576, 1), 2, plan(1, 960, 576, None), 1) == 64  # SmolLM2's qkv at one row
    assert rule((3072, 576), (576, 1), 2, plan(16, 1536, 576, None), 16) == 64  # its gate_up, a verify
    assert rule((3072, 576), (576, 1), 1, plan(1, 1536, 576, None), 1) == 128  # fp8 bytes
    assert rule((6144, 4096), (4096, 1), 2, plan(1, 6144, 4096, None), 1) == 0  # long rows
    assert rule((49152, 576), (576, 1), 2, plan(1, 49152, 576, None), 1) == 0  # an lm_head
    assert rule((576, 576), (576, 1), 2, plan(1, 576, 576, None), 1) == 0  # split: one tile a program
    assert rule((960, 576), (576, 1), 2, plan(65, 960, 576, None), 65) == 0  # past SPLIT_ROWS
    assert rule((960, 576), (640, 1), 2, plan(1, 960, 576, None), 1) == 0  # rows apart: not one block
    assert rule((960, 576), (1, 960), 2, plan(1, 960, 576, None), 1) == 0  # transposed


def test_long_rows_release_late_in_few_row_calls_only():
    """`release_late`: a walking program of a call of at most SPLIT_ROWS rows over rows of
    PREFETCH_K columns or more releases the next kernel after its K loop; not over short
    rows (prefetched instead), for a split weight or in a longer call."""
    late, plan = invariant_mm.release_late, invariant_mm.plan
    assert late(plan(1, 6144, 4096, None), 1, 4096) and late(plan(16, 14336, 4096, None, True), 16, 4096)
    assert late(plan(1, 128256, 4096, None), 1, 4096)  # an lm_head too
    assert not late(plan(1, 960, 576, None), 1, 576)  # short rows
    assert not late(plan(1, 576, 1536, None), 1, 1536)  # split: one tile a program
    assert not late(plan(1, 1536, 8960, None), 1, 8960)  # long rows of a narrow weight split too
    assert not late(plan(65, 6144, 4096, None), 65, 4096)  # past SPLIT_ROWS


def test_a_wide_gate_up_takes_the_whole_weights_tiles():
    """`plan(gated)`: a gate_up's tiles are those of the whole [2n, k] weight; 64-row ones
    keep two stages (a gate and an up tile each)."""
    assert invariant_mm.plan(1, 14336, 4096, None, True)[:4] == (64, 256, 4, 2)
    assert invariant_mm.plan(1, 28672, 4096, None)[:4] == (64, 256, 4, 4)
    assert invariant_mm.plan(1, 1536, 576, None, True)[:4] == invariant_mm.plan(1, 1536, 576, None)[:4]


@pytest.mark.parametrize("n, k", [(800, 200), (2080, 1024)])
def test_a_prefetching_or_late_call_equals_a_longer_one(n, k):
    """A few-row call of an unsplit weight with short rows (prefetched on a GPU) or long
    ones (releasing late) gives the bits of a call past SPLIT_ROWS (neither): the prefetch
    and the release point touch no arithmetic."""
    g = torch.Generator().manual_seed(5)
    m = invariant_mm.SPLIT_ROWS + 1
    assert not invariant_mm.split_k(n, k, 32)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEV, BF16)
    x = torch.randn(m, k, generator=g).to(DEV, BF16)
    whole = kernels.invariant_matmul(x, w)
    for idx in (slice(0, 1), slice(m - 3, m)):
        assert torch.equal(kernels.invariant_matmul(x[idx], w), whole[idx])


def test_row_local_kernels_do_not_depend_on_the_row_count():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max(ROWS), 96, generator=g).to(DEV, BF16)
    w = torch.rand(48, generator=g).to(DEV, BF16)
    heads, kv, dim = 3, 1, 16
    qkv = torch.randn(max(ROWS), heads + 2 * kv, dim, generator=g).to(DEV, BF16)
    cos, sin = (torch.randn(max(ROWS), 1, dim, generator=g).to(DEV, BF16) for _ in range(2))

    def rope(idx: torch.Tensor) -> torch.Tensor:  # the rotated queries and the keys stored at slots idx
        k_cache, v_cache = (torch.zeros(max(ROWS), kv, dim, dtype=BF16, device=DEV) for _ in range(2))
        q = kernels.rope_store_kv(qkv[idx], heads, cos[idx], sin[idx], k_cache, v_cache, idx)
        return torch.cat([q, k_cache[idx], v_cache[idx]], 1)
    for m in ROWS:
        _rows_alone(lambda idx: kernels.rms_norm(x[idx, :48], w, 1e-5), m)
        _rows_alone(lambda idx: torch.cat(kernels.fused_add_rms_norm(x[idx, :48], x[idx, 48:], w, 1e-5), 1), m)
        _rows_alone(lambda idx: kernels.silu_and_mul(x[idx]), m)
        _rows_alone(lambda idx: kernels.embedding(idx, x), m)
        _rows_alone(rope, m)


# -- attention -------------------------------------------------------------------------
# Pieces of at most S_CAP = 2 here (8 in the server), so 72 keys split 64 + 8 and the
# interpreter stays quick: the same code, whatever the cap
L, P, HEADS, KV_HEADS, DIM = 72, 54, 4, 2, 16
SLOTS = 200


class _World:
    """One sequence of L tokens (slots 1..L in table row 0) with random q/k/v, and draft
    trees over positions P.. (table rows 1, 2): the path nodes reuse the sequence's K/V
    slots, siblings get slots of their own with random K/V."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.pool = KVPool(SLOTS, 1, KV_HEADS, DIM, BF16, DEV)
        for t in self.pool.k + self.pool.v:
            t.copy_(torch.randn(t.shape, generator=g))
        self.q = torch.randn(L + 16, HEADS, DIM, generator=g).to(DEV, BF16)  # rows past L: siblings' queries
        self.table = torch.zeros(4, 512, dtype=torch.int64)
        self.table[0, :L] = torch.arange(1, L + 1)
        self.backend = InvariantTritonBackend(DEV)

    def run(self, mode: ForwardMode, rows: list[int], prefix: list[int], extend: list[int], q: torch.Tensor,
            masks: list[torch.Tensor] | None = None, tail: torch.Tensor | None = None,
            backend: object = None) -> torch.Tensor:
        n = q.shape[0]
        zeros = torch.zeros(n, dtype=torch.int64, device=DEV)
        fb = ForwardBatch(mode, zeros, zeros, zeros, torch.tensor(rows, device=DEV), prefix, extend,
                          self.table.to(DEV), self.pool, backend or self.backend, custom_masks=masks,
                          draft_tail=tail)
        fb.attn_backend.init_forward_metadata(fb)
        with torch.no_grad():
            return fb.attn_backend.forward(q, None, None, 0, fb, DIM ** -0.5).view(n, HEADS, DIM)

    def decode(self, positions: list[int]) -> torch.Tensor:
        """Each position decoded, all in one batch."""
        k = len(positions)
        return self.run(ForwardMode.DECODE, [0] * k, positions, [1] * k, self.q[positions])

    def tree(self, row: int, parents: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Verify a tree (node 0 the root at position P; parents[i] < i) whose first-child
        chain is the sequence; returns (outputs [n, H, D], sequence position per node or -1)."""
        n = len(parents)
        pos, sib = [P], L
        mask = torch.zeros(n, n, dtype=torch.bool)
        self.table[row, :P] = self.table[0, :P]
        self.table[row, P] = self.table[0, P]
        mask[0, 0] = True
        q_rows = [P]
        for i in range(1, n):
            parent = parents[i]
            on_chain = pos[parent] >= 0 and pos[parent] + 1 not in pos
            pos.append(pos[parent] + 1 if on_chain else -1)
            slot = int(self.table[0, pos[i]]) if on_chain else SLOTS - 1 - i
            self.table[row, P + i] = slot
            mask[i] = mask[parent]
            mask[i, i] = True
            q_rows.append(pos[i] if on_chain else sib + i)
        out = self.run(ForwardMode.VERIFY, [row], [P], [n], self.q[q_rows], masks=[mask.to(DEV)])
        return out, pos


@pytest.fixture(scope="module")
def world() -> Iterator[_World]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_invariant, "S_CAP", 2)
        yield _World()


def test_decode_is_the_same_alone_or_batched(world):
    positions = [0, 31, 32, 63, 64, 65, L - 1]
    batched = world.decode(positions)
    for i in (0, 4, 5, 6):
        assert torch.equal(world.decode([positions[i]])[0], batched[i]), positions[i]
    ref = world.run(ForwardMode.DECODE, [0] * len(positions), positions, [1] * len(positions),
                    world.q[positions], backend=TorchRefBackend())
    torch.testing.assert_close(batched, ref, rtol=2e-2, atol=2e-2)


def test_prefill_rows_equal_decodes(world):
    whole = world.run(ForwardMode.EXTEND, [0], [0], [L], world.q[:L])
    chunk = world.run(ForwardMode.EXTEND, [0, 0], [20, 60], [10, L - 60], torch.cat([world.q[20:30], world.q[60:L]]))
    positions = list(range(20, 30)) + list(range(60, L))
    decoded = world.decode(positions)
    assert torch.equal(whole[positions], decoded)
    assert torch.equal(chunk, decoded)


def test_tree_nodes_equal_decodes(world):
    # node 1 continues the root, node 2 is its sibling, node 3 continues node 1, node 4 a
    # sibling below node 1, node 5 continues node 3: masked siblings sit between ancestors
    out, pos = world.tree(1, [0, 0, 0, 1, 1, 3])
    chain = [i for i, p in enumerate(pos) if p >= 0]
    assert len(chain) == 4
    assert torch.equal(out[chain], world.decode([pos[i] for i in chain]))
    out2, pos2 = world.tree(2, [0, 0, 1, 2, 0, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    chain2 = [i for i, p in enumerate(pos2) if p >= 0]
    assert torch.equal(out2[chain2], world.decode([pos2[i] for i in chain2]))


def test_a_draft_tail_equals_the_decode(world):
    depth = 5  # keys [0, P) from the row, then the tail's slots of positions P .. P + 4
    tail = world.table[0, P:P + depth].view(1, depth).to(DEV)
    out = world.run(ForwardMode.DECODE, [0], [P], [1], world.q[P + depth - 1:P + depth], tail=tail)
    assert torch.equal(out[0], world.decode([P + depth - 1])[0])


# fused layers (with q/k/v bias; heads of 16 and 32 dims), and not (q/k norms)
@pytest.mark.parametrize("kind, heads", [("llama", 4), ("llama", 2), ("qwen2", 2), ("qwen3", 4)])
def test_a_tiny_models_logits_are_the_same_prefilled_decoded_or_verified(tmp_path, kind, heads):
    """The invariant model on the Triton kernels (the GPU's path): one sequence prefilled
    whole; prefilled in part and decoded a token at a time; and prefilled in part and
    verified as the chain of a tree with a sibling. Same logits, bit for bit. The whole
    prefill is longer than invariant_mm.SPLIT_ROWS: its MLP (K split in three tiles) walks
    the splits in one program, where the decodes and the verify give each split a program."""
    model = load_model(save_tiny_hf(kind, tmp_path / "tiny", num_attention_heads=heads,
                                    num_key_value_heads=heads // 2, intermediate_size=320), BF16, DEV)
    ids = [5, 17, 99, 3, 250, 7, 1, 42, 8] + [(7 * i) % 500 for i in range(60)]
    assert len(ids) > invariant_mm.SPLIT_ROWS
    with kernels.fused_kernels(True):
        model.make_invariant()
        assert model.folded_norms == (kind != "qwen3")
        r = BareRunner(model)
        r.backend = InvariantTritonBackend(DEV)
        whole = r.forward([0], [0], [ids])
        r.forward([1], [0], [ids[:5]])
        decoded = torch.cat([r.forward([1], [5 + i], [[ids[5 + i]]], mode=ForwardMode.DECODE) for i in range(3)])
        r.forward([2], [0], [ids[:5]])
        # nodes: ids[5] (root), ids[6], a sibling of it, ids[7] below ids[6]
        mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        verified = r.forward([2], [5], [[ids[5], ids[6], 300, ids[7]]], positions=[[5, 6, 6, 7]],
                             masks=[mask.to(DEV)], mode=ForwardMode.VERIFY)
    assert whole.dtype == torch.float32
    assert torch.equal(decoded, whole[5:8])
    assert torch.equal(verified[[0, 1, 3]], whole[5:8])


def test_the_fused_layers_compute_what_the_separate_launches_do(tmp_path, monkeypatch):
    """models/invariant.py's fused layers (norms folded) against the same invariant model on
    separate norm, SiLU*mul and add launches: the same logits up to the norms' arithmetic,
    and the aux states (EAGLE-3's) are the stream entering the layers asked for."""
    path = save_tiny_hf("llama", tmp_path / "tiny", num_attention_heads=2, num_key_value_heads=1)
    outs = []
    with kernels.fused_kernels(True):
        for fold in (True, False):
            model = load_model(path, BF16, DEV)
            monkeypatch.setattr(invariant, "fold_norms", invariant.fold_norms if fold else lambda m: False)
            model.make_invariant()
            assert model.folded_norms == fold
            model.aux_layers = (0, 1, model.config.num_layers)
            forward = model.forward_eager

            def keep_aux(fb, forward=forward):
                hidden, aux = forward(fb)
                outs[-1].append(aux)
                return hidden, aux
            monkeypatch.setattr(model, "forward_eager", keep_aux)
            r = BareRunner(model)
            r.backend = InvariantTritonBackend(DEV)
            outs.append([])
            outs[-1].insert(0, r.forward([0], [0], [[5, 17, 99, 3, 250, 7, 1, 42, 8]]))
    (fused_logits, fused_aux), (plain_logits, plain_aux) = outs
    torch.testing.assert_close(fused_logits, plain_logits, rtol=0, atol=2e-2)  # logits up to ~0.65 here
    for a, b in zip(fused_aux, plain_aux, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=2e-2)
