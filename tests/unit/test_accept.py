"""Accept: greedy tree verification, target-only tree sampling (lossless at thresholds 1.0,
shown by chi-square tests that can also fail), mixed batches, force_greedy and logprobs."""
from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from specserve.runner.sampler import SamplingBatch, uniform_noise
from specserve.spec.accept import AcceptResult, accept
from specserve.spec.drafts import Drafts


def _sb(b: int, greedy: bool | list[bool] = False, temperature: float = 1.0,
        top_k: int = 1000) -> SamplingBatch:
    def full(v, dtype=torch.float32):
        return torch.full((b,), v, dtype=dtype)

    g = torch.tensor(greedy if isinstance(greedy, list) else [greedy] * b)
    return SamplingBatch(temperature=full(temperature), greedy=g, top_p=full(1.0),
                         top_k=full(top_k, torch.int64), min_p=full(0.0), seeds=torch.arange(b) * 7919 + 1,
                         counters=torch.zeros(b, dtype=torch.int64))


def _coins(b: int, n: int, salt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request coins from seeds, as the caller derives them."""
    seeds = torch.arange(b, dtype=torch.int64) * 2654435761 + salt
    zero = torch.zeros(b, dtype=torch.int64)
    return uniform_noise(seeds, zero, n), uniform_noise(seeds, zero + 1, 1)[:, 0]


def _greedy(drafts: Drafts, logits: torch.Tensor, **kw) -> AcceptResult:
    b, n = drafts.tokens.shape
    return accept(drafts, logits, _sb(b, greedy=True), *_coins(b, n), **kw)


def _repeat(d: Drafts, b: int) -> Drafts:
    return Drafts(d.tokens.expand(b, -1).clone(), d.parents.expand(b, -1).clone(),
                  d.valid.expand(b, -1).clone())


# ---------------------------------------------------------------- greedy

def _worked_example() -> tuple[Drafts, torch.Tensor]:
    """Internals note 1.4: root -> {10, 11}, 10 -> 20, 11 -> 30, 20 -> 40 (nodes 1..5)."""
    drafts = Drafts.from_lists([[7, 10, 11, 20, 30, 40]], [[-1, 0, 0, 1, 2, 3]])
    logits = torch.zeros(1, 6, 128)
    for node, tok in [(0, 10), (1, 20), (3, 99), (2, 30), (4, 50), (5, 60)]:
        logits[0, node, tok] = 5.0
    return drafts, logits


def test_greedy_worked_example() -> None:
    drafts, logits = _worked_example()
    res = _greedy(drafts, logits)
    assert res.paths == [[0, 1, 3]] and res.tokens == [[10, 20, 99]] and res.accept_lens == [3]
    assert res.logprobs is None


def test_greedy_second_sibling_ragged_batch_and_padding_never_accepted() -> None:
    # Row 0 follows the second child (11 -> 30); row 1 is a 3-node chain padded to 6 nodes,
    # and its target wants token 0 at the root, which only the padding nodes carry.
    drafts = Drafts.from_lists([[7, 10, 11, 20, 30, 40], [7, 3, 5]],
                               [[-1, 0, 0, 1, 2, 3], [-1, 0, 1]])
    assert drafts.valid[1].tolist() == [True, True, True, False, False, False]
    logits = torch.zeros(2, 6, 128)
    for node, tok in [(0, 11), (2, 30), (4, 77)]:
        logits[0, node, tok] = 5.0
    logits[1, 0, 0] = 5.0
    logits[1, 3:, 3] = 9.0  # padding rows are never read
    res = _greedy(drafts, logits)
    assert res.paths == [[0, 2, 4], [0]]
    assert res.tokens == [[11, 30, 77], [0]]


def test_greedy_root_only_gives_the_argmax() -> None:
    drafts = Drafts.from_lists([[5], [6]], [[-1], [-1]])
    logits = torch.randn(2, 1, 50, generator=torch.Generator().manual_seed(0))
    res = _greedy(drafts, logits, want_logprobs=True)
    assert res.paths == [[0], [0]]
    assert res.tokens == [[int(logits[0, 0].argmax())], [int(logits[1, 0].argmax())]]
    assert res.logprobs is not None
    assert math.isclose(res.logprobs[0][0], float(logits[0, 0].log_softmax(-1).max()), abs_tol=1e-6)


def _plain_greedy(tokens: list[int], parents: list[int], valid: list[bool],
                  logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """Oracle: decode greedily one token at a time; go on while a valid child carries it."""
    node, path, out = 0, [0], []
    while True:
        t = int(logits[node].argmax())
        out.append(t)
        nxt = [i for i in range(1, len(tokens))
               if valid[i] and parents[i] == node and tokens[i] == t]
        if not nxt:
            return path, out
        node = nxt[0]
        path.append(node)


@st.composite
def _random_trees(draw) -> tuple[Drafts, torch.Tensor]:
    """Random parents < i and tokens from a 4-token vocab (so matches are common) for every
    node, invalid ones included, and a random validity prefix per row."""
    b, n, vocab = draw(st.integers(1, 3)), draw(st.integers(1, 9)), 4
    parents = [[-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)] for _ in range(b)]
    tokens = [[draw(st.integers(0, vocab - 1)) for _ in range(n)] for _ in range(b)]
    n_valid = [draw(st.integers(1, n)) for _ in range(b)]
    valid = torch.arange(n)[None, :] < torch.tensor(n_valid)[:, None]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = torch.randn(b, n, vocab, generator=gen)
    return Drafts(torch.tensor(tokens), torch.tensor(parents), valid), logits


def _check_structure(drafts: Drafts, res: AcceptResult) -> None:
    for b, (path, toks) in enumerate(zip(res.paths, res.tokens)):
        assert path[0] == 0 and len(toks) == len(path)
        for prev, node in zip(path, path[1:]):
            assert bool(drafts.valid[b, node]) and int(drafts.parents[b, node]) == prev
        assert toks[:-1] == [int(drafts.tokens[b, i]) for i in path[1:]]


@settings(max_examples=150, deadline=None)
@given(_random_trees())
def test_greedy_equals_plain_greedy_decoding(case: tuple[Drafts, torch.Tensor]) -> None:
    drafts, logits = case
    res = _greedy(drafts, logits)
    _check_structure(drafts, res)
    for b in range(drafts.batch_size):
        path, out = _plain_greedy(drafts.tokens[b].tolist(), drafts.parents[b].tolist(),
                                  drafts.valid[b].tolist(), logits[b])
        assert res.paths[b] == path and res.tokens[b] == out
        assert res.tokens[b][-1] == int(logits[b, path[-1]].argmax())


@settings(max_examples=100, deadline=None)
@given(_random_trees(), st.integers(0, 3))
def test_device_paths_before_the_read_back_match_the_result(case: tuple[Drafts, torch.Tensor], extra: int) -> None:
    """The hook sees, on the device, the paths and committed tokens the host reads back
    (padded with 0 to the length asked for), and runs exactly once."""
    drafts, logits = case
    seen = []
    length = drafts.num_nodes + extra
    res = _greedy(drafts, logits, before_read=seen.append)
    assert len(seen) == 1
    got = seen[0].paths(length)
    assert got.nodes.shape == got.tokens.shape == (drafts.batch_size, length)
    for b, (path, toks) in enumerate(zip(res.paths, res.tokens)):
        k = len(path)
        assert int(got.lens[b]) == k
        assert got.nodes[b].tolist() == path + [0] * (length - k)
        assert got.tokens[b].tolist() == toks + [0] * (length - k)


def test_the_hook_is_not_called_for_sampled_walks() -> None:
    drafts, logits = _worked_example()
    seen = []
    accept(drafts, logits, _sb(1), *_coins(1, 6), before_read=seen.append)
    assert seen == []


@settings(max_examples=100, deadline=None)
@given(_random_trees(), st.integers(0, 2**20))
def test_sampled_paths_are_valid_and_bonus_avoids_rejected_children(
        case: tuple[Drafts, torch.Tensor], salt: int) -> None:
    drafts, logits = case
    b, n = drafts.tokens.shape
    res = accept(drafts, logits, _sb(b, top_k=3), *_coins(b, n, salt))
    _check_structure(drafts, res)
    for r, (path, toks) in enumerate(zip(res.paths, res.tokens)):
        last = path[-1]
        rejected = {int(drafts.tokens[r, i]) for i in range(n)
                    if drafts.valid[r, i] and i > 0 and int(drafts.parents[r, i]) == last}
        kept = set(logits[r, last].topk(3).indices.tolist())  # top_k=3 support
        assert toks[-1] in kept
        if not kept <= rejected:  # some unrejected mass is left: the bonus comes from it
            assert toks[-1] not in rejected


# ---------------------------------------------------------------- sampling: hand-computed

def _probs_logits(rows: list[list[float]], temperature: float = 1.0) -> torch.Tensor:
    """Logits whose tempered softmax is exactly the given distributions: T * log p."""
    return temperature * torch.tensor(rows).log()[None]


def test_sampling_walk_by_hand_and_thresholds() -> None:
    # Root children: node 1 (token 3, q=.4), node 2 (token 1, q=.2). Node 2 is a leaf.
    drafts = Drafts.from_lists([[9, 3, 1]], [[-1, 0, 0]])
    logits = _probs_logits([[0.1, 0.2, 0.3, 0.4]] + [[0.5, 0.25, 0.125, 0.125]] * 2)

    def run(coin: float, final: float, **kw) -> AcceptResult:
        return accept(drafts, logits, _sb(1), torch.tensor([[coin, 0.5, 0.5]]),
                      torch.tensor([final]), **kw)

    assert run(0.3, 0.1).tokens == [[3, 0]]  # .3 <= .4: node 1, bonus from its q
    assert run(0.5, 0.6).tokens == [[1, 1]]  # .4 < .5 <= .6: node 2 (leaf), bonus ~ q
    # .65 > .6: both rejected; bonus ~ relu(q - removed) = [.1, 0, .3, 0] / .4 = [.25, 0, .75, 0]
    assert run(0.65, 0.2).tokens == [[0]] and run(0.65, 0.3).tokens == [[2]]
    assert run(0.65, 0.2).paths == [[0]]
    assert run(0.99, 0.1, threshold_single=0.3).tokens == [[3, 0]]  # q=.4 >= .3: no coin
    assert run(0.7, 0.1, threshold_acc=0.5).tokens == [[3, 0]]  # .7 <= .4 / .5
    assert run(0.7, 0.2, threshold_acc=0.0).paths == [[0, 1]]  # clamped to 1e-9, no div by 0


def test_duplicated_sibling_adds_no_mass() -> None:
    # Children tokens 3, 3, 1: the second 3 must not widen the acceptance window to .8.
    drafts = Drafts.from_lists([[9, 3, 3, 1]], [[-1, 0, 0, 0]])
    logits = _probs_logits([[0.1, 0.2, 0.3, 0.4]] * 4)
    res = accept(drafts, logits, _sb(1), torch.tensor([[0.5, 0.5, 0.5, 0.5]]), torch.tensor([0.1]))
    assert res.paths == [[0, 3]] and res.tokens[0][0] == 1  # .4 < .5 <= .4 + 0 + .2


# ---------------------------------------------------------------- sampling: statistics

TRIALS = 20000


def _filtered(p: list[float], top_k: int) -> torch.Tensor:
    """Independent oracle for q: drop all but the top_k entries, renormalise."""
    q = torch.tensor(p, dtype=torch.float64)
    q[q.argsort(descending=True)[top_k:]] = 0.0
    return q / q.sum()


def _pvalue(samples: list[int], q: torch.Tensor) -> float:
    """Chi-square of observed token counts against q; zero-probability tokens must not occur."""
    counts = torch.bincount(torch.tensor(samples), minlength=len(q)).double()
    assert counts[q == 0].sum() == 0, f"sampled a token of probability 0: {counts.tolist()}"
    keep = q > 0
    return chisquare(counts[keep], q[keep] / q[keep].sum() * counts.sum()).pvalue


def _next_after(tokens: list[list[int]], prefix: tuple[int, ...]) -> list[int]:
    k = len(prefix)
    return [t[k] for t in tokens if len(t) > k and tuple(t[:k]) == prefix]


def _run_many(drafts: Drafts, rows: list[list[float]], trials: int = TRIALS,
              temperature: float = 0.8, top_k: int = 5, **kw) -> list[list[int]]:
    n = drafts.num_nodes
    logits = _probs_logits(rows, temperature).expand(trials, -1, -1).contiguous()
    res = accept(_repeat(drafts, trials), logits, _sb(trials, temperature=temperature, top_k=top_k),
                 *_coins(trials, n, salt=12345), **kw)
    return res.tokens


# Chain root -> 2 -> 4 -> 1; each row's smallest entry is cut by top_k=5.
CHAIN = Drafts.from_lists([[0, 2, 4, 1]], [[-1, 0, 1, 2]])
CHAIN_ROWS = [[0.10, 0.05, 0.35, 0.15, 0.25, 0.10],
              [0.20, 0.15, 0.10, 0.05, 0.30, 0.20],
              [0.25, 0.30, 0.15, 0.10, 0.05, 0.15],
              [0.05, 0.20, 0.25, 0.20, 0.15, 0.15]]
# Root children: node 1 (2), node 2 (4, leaf), node 3 (2 again), node 4 (5, cut by top-k at
# the root). Node 1 -> {5 (1), 6 (3, leaf)}, node 5 -> 7 (0, leaf). Rows 3 and 4 are never
# reached: a walk that used the duplicate's row would show in the chi-square.
TREE = Drafts.from_lists([[0, 2, 4, 2, 5, 1, 3, 0]], [[-1, 0, 0, 0, 0, 1, 1, 5]])
TREE_ROWS = [[0.15, 0.10, 0.30, 0.12, 0.25, 0.08],
             [0.10, 0.30, 0.05, 0.25, 0.18, 0.12],
             [0.30, 0.05, 0.20, 0.15, 0.10, 0.20],
             [0.45, 0.06, 0.09, 0.12, 0.13, 0.15],
             [0.05, 0.35, 0.20, 0.15, 0.10, 0.15],
             [0.22, 0.18, 0.14, 0.20, 0.04, 0.22],
             [0.12, 0.16, 0.20, 0.24, 0.20, 0.08],
             [0.16, 0.15, 0.17, 0.18, 0.16, 0.18]]


def _pair_pvalue(tokens: list[list[int]], q_root: torch.Tensor,
                 q_after: dict[int, torch.Tensor]) -> float:
    """Joint (first, second) over the trials whose first token is drafted, against
    q_root(first) * q_node(first)(second), both renormalised to the conditioning event."""
    drafted = torch.tensor(sorted(q_after))
    expected = torch.stack([q_root[a] * q_after[a] for a in drafted.tolist()])  # [D, V]
    index = {a: k for k, a in enumerate(drafted.tolist())}
    observed = torch.zeros_like(expected)
    for t in tokens:
        if t[0] in index:
            observed[index[t[0]], t[1]] += 1
    assert observed[expected == 0].sum() == 0
    keep = expected > 0
    e = expected[keep] / expected[keep].sum() * observed.sum()
    return chisquare(observed[keep], e).pvalue


def test_chain_sampling_is_lossless() -> None:
    q = [_filtered(r, 5) for r in CHAIN_ROWS]
    tokens = _run_many(CHAIN, CHAIN_ROWS)
    assert _pvalue([t[0] for t in tokens], q[0]) > 1e-4
    assert _pair_pvalue(tokens, q[0], {2: q[1]}) > 1e-4
    assert _pvalue(_next_after(tokens, (2,)), q[1]) > 1e-4
    assert _pvalue(_next_after(tokens, (2, 4)), q[2]) > 1e-4
    assert _pvalue(_next_after(tokens, (2, 4, 1)), q[3]) > 1e-4  # leaf: bonus ~ q
    assert max(len(t) for t in tokens) == 4


def test_tree_sampling_with_duplicate_and_filtered_drafts_is_lossless() -> None:
    q = [_filtered(r, 5) for r in TREE_ROWS]
    tokens = _run_many(TREE, TREE_ROWS)
    assert _pvalue([t[0] for t in tokens], q[0]) > 1e-4  # token 5 (drafted, cut) never appears
    assert _pair_pvalue(tokens, q[0], {2: q[1], 4: q[2]}) > 1e-4
    for prefix, node in [((2,), 1), ((4,), 2), ((2, 1), 5), ((2, 3), 6), ((2, 1, 0), 7)]:
        assert _pvalue(_next_after(tokens, prefix), q[node]) > 1e-4, prefix


def test_relaxed_thresholds_are_detectably_lossy() -> None:
    q0 = _filtered(CHAIN_ROWS[0], 5)  # the drafted token 2 has q = .368
    for kw in [dict(threshold_single=0.3), dict(threshold_acc=0.5)]:
        tokens = _run_many(CHAIN, CHAIN_ROWS, trials=5000, **kw)
        assert _pvalue([t[0] for t in tokens], q0) < 1e-6, kw


# ---------------------------------------------------------------- mixed batches

def _mixed_case() -> tuple[Drafts, torch.Tensor, SamplingBatch, torch.Tensor, torch.Tensor]:
    drafts = Drafts.from_lists([[1, 2, 3, 4, 5], [1, 2], [1, 4, 4, 2, 3, 0], [7, 3, 2, 1]],
                               [[-1, 0, 0, 1, 3], [-1, 0], [-1, 0, 1, 1, 0, 4], [-1, 0, 1, 2]])
    # Peaked logits around the drafted tokens so sampled rows accept a few.
    logits = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(3))
    for b in range(4):
        for i in range(1, 6):
            if drafts.valid[b, i]:
                logits[b, int(drafts.parents[b, i]), int(drafts.tokens[b, i])] += 2.5
    sb = _sb(4, greedy=[True, False, True, False], temperature=0.7, top_k=6)
    return (drafts, logits, sb, *_coins(4, 6, salt=99))


def test_mixed_batch_rows_are_independent_and_force_greedy() -> None:
    drafts, logits, sb, coins, final = _mixed_case()
    res = accept(drafts, logits, sb, coins, final, want_logprobs=True)
    _check_structure(drafts, res)
    for b in range(4):
        path, out = _plain_greedy(drafts.tokens[b].tolist(), drafts.parents[b].tolist(),
                                  drafts.valid[b].tolist(), logits[b])
        if b in (0, 2):
            assert (res.paths[b], res.tokens[b]) == (path, out)
        one = Drafts(drafts.tokens[b:b + 1], drafts.parents[b:b + 1], drafts.valid[b:b + 1])
        sb1 = _sb(1, greedy=bool(sb.greedy[b]), temperature=0.7, top_k=6)
        alone = accept(one, logits[b:b + 1], sb1, coins[b:b + 1], final[b:b + 1])
        assert alone.tokens[0] == res.tokens[b]  # a row's result ignores its batch neighbours
    forced = accept(drafts, logits, sb, coins, final, force_greedy=True)
    for b in range(4):
        path, out = _plain_greedy(drafts.tokens[b].tolist(), drafts.parents[b].tolist(),
                                  drafts.valid[b].tolist(), logits[b])
        assert (forced.paths[b], forced.tokens[b]) == (path, out)


def test_logprobs_are_raw_log_softmax_at_the_producing_node() -> None:
    drafts, logits, sb, coins, final = _mixed_case()
    res = accept(drafts, logits, sb, coins, final, want_logprobs=True)
    assert res.logprobs is not None and sum(map(len, res.tokens)) > 4 + 2  # some drafts accepted
    logp = logits.log_softmax(-1)  # unprocessed: no temperature, no top-k
    for b in range(4):
        assert len(res.logprobs[b]) == len(res.tokens[b])
        for node, tok, lp in zip(res.paths[b], res.tokens[b], res.logprobs[b]):
            assert math.isclose(lp, float(logp[b, node, tok]), abs_tol=1e-5)
