"""The speculative step's Triton kernels (specserve.kernels: top-k log-probabilities, the
drafting depth's frontier, node selection, Gumbel noise, the greedy accept walk) against
the torch paths they replace, compiled on CUDA and under the interpreter on CPU."""
from __future__ import annotations

import pytest  # noqa: E402
import torch

from tests.unit.fused_utils import DEV  # first: sets TRITON_INTERPRET on CPU
from tests.unit.fused_utils import both as _both

pytest.importorskip("triton")

from specserve import kernels  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,vocab,k", [(1, 16384, 4), (6, 1000, 8), (3, 77, 1), (2, 32768, 2)])
@pytest.mark.parametrize("mapped", [False, True])
def test_topk_logprobs_is_the_tree_drafters_torch_path(rows, vocab, k, mapped, dtype):
    """One launch gives what top_children's torch path gives: the k best entries in
    descending order, their log-softmax values, their ids through the draft vocabulary's
    map (random logits: no ties)."""
    from specserve.spec.tree.draft import top_children

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


@pytest.mark.parametrize("rows", [1, 3])
def test_topk_logprobs_into_root_state_rows(rows):
    """With `into` the same results also land in rows dst of the two buffers (RootStates'
    logp and ids), every other row untouched, on both paths."""
    from specserve.spec.tree.draft import top_children

    torch.manual_seed(rows)
    logits, token_map = torch.randn(rows, 3000, device=DEV), torch.randperm(9000, device=DEV)[:3000]
    dst = torch.randperm(7, device=DEV)[:rows]
    start_vals, start_ids = torch.randn(7, 4, device=DEV), torch.randint(0, 99, (7, 4), device=DEV)
    bufs = []

    def run():
        into = (dst, start_vals.clone(), start_ids.clone())
        bufs.append(into[1:])
        return top_children(logits, 4, token_map, into=into)

    (logp, ids), (logp0, ids0) = _both(run)
    assert torch.equal(ids, ids0)
    torch.testing.assert_close(logp, logp0, rtol=1e-5, atol=1e-5)
    other = torch.ones(7, dtype=torch.bool, device=DEV)
    other[dst] = False
    for (vals, idx), (want_v, want_i) in zip(bufs, ((logp, ids), (logp0, ids0))):
        assert torch.equal(vals[dst], want_v) and torch.equal(idx[dst], want_i)
        assert torch.equal(vals[other], start_vals[other]) and torch.equal(idx[other], start_ids[other])


def test_topk_logprobs_leaves_long_rows_to_torch():
    assert kernels.topk_logprobs(torch.zeros(1, 40000, device=DEV), 4) is None


@pytest.mark.parametrize("bsz,k,steps,hidden", [(1, 4, 5, 8), (3, 2, 4, 0), (2, 4, 2, 16), (2, 1, 3, 4), (2, 4, 1, 8)])
def test_tree_expansion_fused_is_the_torch_path(bsz, k, steps, hidden):
    """A whole drafting pass (TreeDrafter.expand) with the fused per-depth kernels (top-k
    children, frontier bookkeeping) against the torch ops they replace: every draft forward
    sees the same frontier (tokens, positions, tails of ancestor slots, branch states) and
    the trees are the same. The draft is a random function of all of those."""
    from specserve.spec.tree.draft import TreeDrafter, TreeInputs

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
    from specserve.kernels import argmax
    from specserve.spec.accept import _accept_greedy

    monkeypatch.setattr(argmax, "CHUNK", chunk)

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
    from specserve.spec.tree.draft import _select

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
    # into the caller's buffers (a step graph's static trees), both paths
    n = n_sel + 1
    outs = [(torch.full((bsz, n), -9, device=DEV), torch.full((bsz, n), -9, device=DEV),
             torch.zeros(bsz, n, n, dtype=torch.bool, device=DEV)) for _ in range(2)]
    got_out, ref_out = _both(lambda: _select(roots, scores, tokens, parents, n_sel, steps, outs.pop()))
    for a, b, want in zip(got_out, ref_out, ref):
        assert torch.equal(a, want) and torch.equal(b, want)


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
