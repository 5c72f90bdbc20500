"""Accept: from the target's logits over a draft tree, pick each request's committed tokens.

Owns the acceptance rule and nothing else. Given `Drafts` (node 0 = root) and the target's
logits at every node (row i = the distribution of the token *after* node i), it returns per
request the accepted path (root first), the committed tokens (one per accepted draft, then
the bonus token sampled at the last accepted node) and, on request, their logprobs.

  * greedy rows: follow the child equal to the target's argmax; the output is token-identical
    to plain greedy decoding.
  * sampling rows: SGLang's "target-only" tree sampling (internals note 1.7). Drafts are a
    deterministic top-k, so the proposal is one-hot and the exact rule is "sample from q,
    accept the child carrying the sample": one coin per depth, inverse CDF over the children
    in preference order, residual sampling when no child matches. At threshold_single =
    threshold_acc = 1 the committed tokens are distributed exactly as plain sampling.

It does not know: proposers, KV slots, finish checks (EOS / stop / max_tokens are applied by
the caller to the returned run), penalties or logit bias (the caller applies them to `logits`
first), or where coins come from (the caller derives them from per-request seeds). It never
draws randomness itself.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specserve import kernels
from specserve.core.h2d import ready_event
from specserve.runner.sampler import SamplingBatch, filter_floors, filter_logits, filtered, gumbel_noise, temperatures
from specserve.spec.drafts import Drafts
from specserve.spec.walk_host import walk_host


@dataclass
class AcceptResult:
    paths: list[list[int]]  # per request: accepted nodes, root first; each a child of the previous
    tokens: list[list[int]]  # per request: tokens of paths[1:], then the bonus; len == len(paths)
    logprobs: list[list[float]] | None = None  # log p(token) under the raw (unprocessed) logits

    @property
    def accept_lens(self) -> list[int]:
        """Accepted drafts + 1 per request (SGLang's `accept len`)."""
        return [len(t) for t in self.tokens]


@dataclass
class DevicePaths:
    """The accepted paths of a greedy walk before their read-back, padded to L columns."""

    nodes: torch.Tensor  # [B, L] accepted nodes, root first; 0 past lens
    tokens: torch.Tensor  # [B, L] committed tokens: those of nodes[1:], then the bonus; 0 past lens
    lens: torch.Tensor  # [B] committed tokens per request (path length, >= 1)


@dataclass
class GreedyWalk:
    """A greedy walk's outcome on the device, before its read-back: what a proposer needs
    to start the next step's drafting (EAGLE's draft_ahead)."""

    on_path: torch.Tensor  # [B, N] nonzero at the accepted nodes (ancestors-or-self of the deepest)
    tokens: torch.Tensor  # [B, N] the trees' tokens
    bonus: torch.Tensor  # [B] the target's token after the deepest accepted node

    def paths(self, length: int) -> DevicePaths:
        """The paths padded to `length` (> the trees' depth), with torch ops on the device."""
        return device_paths(self.on_path.bool(), self.tokens, self.bonus, length)


# Called with the walk on the device, before the host reads it back
BeforeRead = Callable[[GreedyWalk], None]


def accept(drafts: Drafts, logits: torch.Tensor, sb: SamplingBatch, coins: torch.Tensor,
           final_coins: torch.Tensor, threshold_single: float = 1.0, threshold_acc: float = 1.0,
           force_greedy: bool = False, want_logprobs: bool = False,
           before_read: BeforeRead | None = None) -> AcceptResult:
    """logits [B, N, V] float32; coins [B, N] (the coin drawn at node i decides among i's
    children) and final_coins [B] (the bonus), uniforms in (0, 1); sb has [B] rows.

    `before_read`: when every row walks greedily, before_read(GreedyWalk) runs after the
    walk is queued and before the host waits for it, so GPU work it queues overlaps the
    read-back and what the host does next. It is not called otherwise (the sampled walk
    runs on the host)."""
    bsz, n, _ = logits.shape
    assert drafts.tokens.shape == (bsz, n), f"drafts {tuple(drafts.tokens.shape)} vs {logits.shape}"
    assert coins.shape == (bsz, n) and final_coins.shape == (bsz,)
    all_greedy = force_greedy or sb.all_greedy  # host-side when the batch carries flags: no sync
    greedy = [True] * bsz if all_greedy else sb.greedy.tolist()
    paths: list[list[int]] = [[] for _ in range(bsz)]
    tokens: list[list[int]] = [[] for _ in range(bsz)]

    g_rows = [b for b in range(bsz) if greedy[b]]
    if g_rows:
        hook = before_read if len(g_rows) == bsz else None
        for b, path, tok in zip(g_rows, *_accept_greedy(drafts, logits, None if len(g_rows) == bsz else g_rows, hook)):
            paths[b], tokens[b] = path, tok

    s_rows = [b for b in range(bsz) if not greedy[b]]
    if s_rows:
        first, sibling = (t.tolist() for t in drafts.child_lists())
        s_paths, s_tokens = _accept_sampled(drafts, (first, sibling, drafts.tokens.tolist()), logits, sb,
                                            s_rows, coins, final_coins, threshold_single,
                                            max(threshold_acc, 1e-9))
        for b, path, tok in zip(s_rows, s_paths, s_tokens):
            paths[b], tokens[b] = path, tok

    logprobs = _logprobs(logits, paths, tokens) if want_logprobs else None
    return AcceptResult(paths, tokens, logprobs)


# Host trees on a GPU walk on the host up to this many rows: the walk over Python lists costs
# more a row than parsing the device walk's result, which the device walk's four host-to-device
# copies outweigh only at small batches (docs/benchmarks.md)
HOST_WALK_ROWS = 16


def _accept_greedy(drafts: Drafts, logits: torch.Tensor, rows: list[int] | None,
                   before_read: BeforeRead | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """(paths, tokens) of the greedy walk for `rows` (None: all), with one read back (on
    the CPU, and for trees drafted on the host, the walk itself runs on the host:
    spec/walk_host.py)."""
    on_host = not drafts.tokens.is_cuda and (logits.shape[0] <= HOST_WALK_ROWS if logits.is_cuda
                                             else not kernels.use_fused(logits))
    if rows is None and before_read is None and on_host:
        return walk_host(drafts, logits)
    packed, walk = walk_greedy(drafts, logits, rows)
    if before_read is None:
        return _parse_walk(packed.tolist(), walk.tokens.shape[1])  # the one sync
    result = _read_after(packed, lambda: before_read(walk)).result()
    return result.paths, result.tokens


def accept_greedy_later(drafts: Drafts, logits: torch.Tensor, before_read: BeforeRead) -> PendingAccept:
    """Every row greedy: queue the walk, `before_read(walk)` and the walk's copy to the
    host, and wait for none of it (spec/pipeline.py reads it back a step later)."""
    packed, walk = walk_greedy(drafts, logits, None)
    return _read_after(packed, lambda: before_read(walk))


def walk_greedy(drafts: Drafts, logits: torch.Tensor, rows: list[int] | None,
                sampled: SamplingBatch | None = None) -> tuple[torch.Tensor, GreedyWalk]:
    """The greedy walk for `rows` (None: all) on the logits' device, read nothing back:
    (packed [G, 2N + 1] = on_path, node tokens, bonus; the walk's device tensors). The
    walk from the root at each node takes the first child (in node order) carrying the
    target's argmax there. With `sampled` (every row), the targets are seeded sampling's
    (`gumbel_targets`): the walk kernel forms them as it reads the logits where only
    temperatures apply, and they are formed in torch first otherwise.

    Vectorised: a node *hits* when it is valid, carries the argmax at its parent and no
    earlier sibling hits; it is accepted when it and all its ancestors hit. Hits are
    unique per parent, so the accepted nodes form one path from the root, and the walk
    ends at its deepest node, whose argmax is the bonus token."""
    dev = logits.device
    idx = torch.tensor(rows, dtype=torch.int64) if rows is not None else None

    def pick(t: torch.Tensor) -> torch.Tensor:  # the walked rows, on the logits' device
        return (t[idx.to(t.device)] if idx is not None else t).to(dev, non_blocking=True)

    if idx is not None:
        logits = logits[idx.to(dev, non_blocking=True)]
    tok, par, valid, mask = pick(drafts.tokens), pick(drafts.parents), pick(drafts.valid), pick(drafts.tree_mask())
    n = tok.shape[1]
    fused = kernels.use_fused(logits)
    tempered = None
    if sampled is not None:
        assert idx is None, "a sampled walk takes every row"
        if fused:
            counters = sampled.counters[:, None] + drafts.depths().to(sampled.counters.device)  # [B, N]
            floors = None
            if filtered(sampled, logits.shape[-1]):  # each node's floor under its request's params
                floors = filter_floors(logits.reshape(-1, logits.shape[-1]), sampled, per_request=n)
            tempered = kernels.Tempered(sampled.temperature, sampled.greedy, sampled.seeds, counters.reshape(-1), n,
                                        floors)
        else:
            logits = gumbel_targets(logits, sampled, drafts.depths())
    packed = kernels.greedy_walk(tok, par, valid, mask, logits, tempered) if fused else None
    if packed is None and tempered is not None:  # trees too large for the kernel
        assert sampled is not None, "tempered walks are sampled ones"
        logits = gumbel_targets(logits, sampled, drafts.depths())
    if packed is not None:  # kernels/walk.py: the argmax and the same walk in two launches
        on_path, bonus = packed[:, :n], packed[:, 2 * n:]  # views: the readers take nonzero and strides
    else:
        on_path, bonus = _walk_torch(tok, par, valid, mask, logits.argmax(-1))  # [G, N]: no copy of the logits
        packed = torch.cat([on_path.to(torch.int64), tok, bonus], dim=1)
    return packed, GreedyWalk(on_path, tok, bonus[:, 0])


def _parse_walk(host: list[list[int]], n: int) -> tuple[list[list[int]], list[list[int]]]:
    """(paths, tokens) from the walk's packed rows read back."""
    paths, tokens = [], []
    for row in host:
        path = [i for i in range(n) if row[i]]  # node order == depth order along a path
        paths.append(path)
        tokens.append([row[n + i] for i in path[1:]] + [row[2 * n]])
    return paths, tokens


def _walk_torch(tok: torch.Tensor, par: torch.Tensor, valid: torch.Tensor, mask: torch.Tensor,
                target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(on_path [G, N] bool, bonus [G, 1]) of the greedy walk with torch ops (the
    reference of kernels/walk.py; see _accept_greedy). mask: the trees' ancestor-or-self
    masks [G, N, N]."""
    dev, n = tok.device, tok.shape[1]
    hit = (tok == target.gather(1, par.clamp_min(0))) & valid
    hit[:, 0] = True  # the root is given
    earlier = torch.ones(n, n, dtype=torch.bool, device=dev).tril(-1)  # [i, j]: j < i
    shadowed = ((par[:, :, None] == par[:, None, :]) & earlier & hit[:, None, :]).any(-1)
    hit &= ~shadowed
    accepted = ~(mask & ~hit[:, None, :]).any(-1)  # [G, N]: every ancestor-or-self hits
    # the path's deepest node: parents come before children, so the accepted node of largest index
    best = torch.where(accepted, torch.arange(n, device=dev), -1).argmax(-1)
    on_path = mask[torch.arange(len(best), device=dev), best]  # [G, N]: its ancestors-or-self
    return on_path, target.gather(1, best[:, None])


def device_paths(on_path: torch.Tensor, tok: torch.Tensor, bonus: torch.Tensor, length: int) -> DevicePaths:
    """DevicePaths [G, length] from a walk's on_path [G, N] (ancestors-or-self of the deepest
    accepted node), node tokens [G, N] and bonus tokens [G], with device ops only. The
    caller guarantees length > the trees' depth (checking it would read the device)."""
    g, n = on_path.shape
    dev = on_path.device
    idx = torch.arange(n, device=dev)
    order = torch.where(on_path, idx, n).sort(dim=1).values  # path nodes first: node order is depth order
    if length > n:
        order = torch.cat([order, order.new_full((g, length - n), n)], dim=1)
    lens = on_path.sum(1)
    nodes = torch.where(order[:, :length] < n, order[:, :length], 0)
    col = torch.arange(length, device=dev)
    nxt = torch.cat([nodes[:, 1:], nodes[:, :1]], dim=1)  # committed token j comes from node j + 1 ...
    tokens = torch.where(col < lens[:, None] - 1, tok.gather(1, nxt), 0)
    tokens = torch.where(col == lens[:, None] - 1, bonus[:, None], tokens)  # ... and the last is the bonus
    return DevicePaths(nodes, tokens, lens)


@dataclass
class PendingAccept:
    """A greedy walk's packed rows on their way to the host: `result()` waits for that
    copy alone, not for the GPU work queued behind it."""

    host: torch.Tensor  # [B, 2N + 1], valid once `ready` fired
    ready: torch.cuda.Event | None  # None on a CPU, where the copy was synchronous
    n: int

    def result(self) -> AcceptResult:
        if self.ready is not None:
            self.ready.synchronize()
        return AcceptResult(*_parse_walk(self.host.tolist(), self.n))


def read_later(packed: torch.Tensor) -> PendingAccept:
    """A walk's packed rows [B, 2N + 1] on their way to the host, waited on by `result()`."""
    return _read_after(packed, lambda: None)


def _read_after(packed: torch.Tensor, work: Callable[[], None]) -> PendingAccept:
    """packed's copy to the host, with `work` queued on the device behind it."""
    n = (packed.shape[1] - 1) // 2
    if packed.device.type != "cuda":
        work()
        return PendingAccept(packed, None, n)
    host = packed.to("cpu", non_blocking=True)  # lands in pinned memory: queued, not waited on
    ready = ready_event(packed.device)
    work()
    return PendingAccept(host, ready, n)


def _walk_sampled(first: list[int], sibling: list[int], toks: list[int], q_tok: list[float],
                  coins: list[float], th_single: float,
                  th_acc: float) -> tuple[list[int], list[int]]:
    """(accepted path, tokens of the children tried and rejected at its last node).

    q_tok[i] = q at node i's parent of node i's token. A token already tried among the
    siblings adds nothing the second time (its mass was already tested), so a duplicated
    draft can neither be double-counted nor accepted on its own."""
    path, last = [0], 0
    while True:
        cur, prob_acc, tried, coin = first[last], 0.0, [], coins[last]
        while cur != -1:
            q = 0.0 if toks[cur] in tried else q_tok[cur]
            prob_acc += q
            if coin <= prob_acc / th_acc or q >= th_single:
                break
            tried.append(toks[cur])
            cur = sibling[cur]
        if cur == -1:
            return path, tried
        path.append(cur)
        last = cur


def _accept_sampled(drafts: Drafts, tree: tuple[list, list, list], logits: torch.Tensor,
                    sb: SamplingBatch, rows: list[int], coins: torch.Tensor,
                    final_coins: torch.Tensor, th_single: float,
                    th_acc: float) -> tuple[list[list[int]], list[list[int]]]:
    """Target-only tree sampling for the sampled rows (indices into the batch); tree holds
    the batch's (first_child, next_sibling, tokens) as lists."""
    s, n, vocab = len(rows), logits.shape[1], logits.shape[2]
    idx = torch.tensor(rows, device=logits.device)
    q = _target_probs(logits[idx], sb, idx)  # [S, N, V]
    # q_tok[s, i] = q[s, parent(i), token(i)]: the target's probability of each drafted token.
    parent = drafts.parents[rows].clamp_min(0).to(logits.device)
    tok = torch.where(drafts.valid[rows], drafts.tokens[rows], 0).to(logits.device)  # padding: any
    flat = parent * vocab + tok  # [S, N] indices into q viewed as [S, N*V]
    q_tok = q.reshape(s, n * vocab).gather(1, flat).tolist()
    first, sibling, toks = ([t[b] for b in rows] for t in tree)
    coin_l = coins.to(logits.device)[idx].tolist()
    # Target-only acceptance, draft one-hot: at node `last` one coin u; child k (in order) is
    #   accepted iff u <= (sum_{j<=k} q[tok_j]) / theta_acc  or  q[tok_k] >= theta_single;
    #   none accepted -> bonus ~ relu(q - q*1[tried]) / Z. At theta = 1: every token ~ q exactly.
    walks = [_walk_sampled(first[r], sibling[r], toks[r], q_tok[r], coin_l[r], th_single, th_acc)
             for r in range(s)]
    last = torch.tensor([path[-1] for path, _ in walks], device=logits.device)
    q_last = q[torch.arange(s, device=logits.device), last]  # [S, V]
    u_final = final_coins.to(logits.device)[idx]
    bonus = _sample_residual(q_last, [tried for _, tried in walks], u_final)
    paths = [path for path, _ in walks]
    tokens = [[toks[r][i] for i in paths[r][1:]] + [bonus[r]] for r in range(s)]
    return paths, tokens


def per_node_batch(sb: SamplingBatch, rows: torch.Tensor, n: int) -> SamplingBatch:
    """The [B] params of requests `rows`, each repeated for its n nodes: [len(rows) * n]."""
    per_node: dict[str, Any] = {}
    for f in dataclasses.fields(sb):
        value = getattr(sb, f.name)
        if isinstance(value, torch.Tensor) and value.dim() == 1:
            per_node[f.name] = value[rows.to(value.device)].repeat_interleave(n)
    return dataclasses.replace(sb, **per_node)


def _target_probs(logits: torch.Tensor, sb: SamplingBatch, rows: torch.Tensor) -> torch.Tensor:
    """[S, N, V] logits -> q = softmax(filter_logits) with each request's params on its N rows."""
    s, n, vocab = logits.shape
    node_sb = per_node_batch(sb, rows, n)
    return filter_logits(logits.reshape(s * n, vocab), node_sb).softmax(-1).reshape(s, n, vocab)


def gumbel_targets(logits: torch.Tensor, sb: SamplingBatch, depths: torch.Tensor) -> torch.Tensor:
    """[B, N, V] logits whose argmax at each node is the token plain sampling would draw there.

    Sampled rows get filter_logits + Gumbel noise keyed by (seed, output index + depth), the
    exact noise `runner.sampler.sample` uses for that output position; greedy rows keep their
    logits. A greedy walk over these targets is exact sampling (each committed token is
    a draw from q given its prefix), and with a seed it reproduces plain decoding token
    for token, whatever the draft tree was.
    """
    b, n, vocab = logits.shape
    counters = sb.counters[:, None] + depths.to(sb.counters.device)  # [B, N]: output index at each node
    noise = gumbel_noise(sb.seeds.repeat_interleave(n), counters.reshape(-1), vocab).view(b, n, vocab)
    if filtered(sb, vocab):  # filters: each request's params on its N rows
        flat = logits.reshape(b * n, vocab)
        scaled = filter_logits(flat, per_node_batch(sb, torch.arange(b), n)).view(b, n, vocab)
    else:  # temperature alone: no per-node copies of the params
        scaled = logits / temperatures(sb)[:, None, None]
    return torch.where(sb.greedy[:, None, None], logits, scaled + noise)


def _sample_residual(q: torch.Tensor, tried: list[list[int]], u: torch.Tensor) -> list[int]:
    """Inverse-CDF sample per row from relu(q - removed), removed = q on the tried tokens.

    q [S, V]; u [S] in (0, 1). With nothing tried this samples q itself (the leaf case)."""
    s, vocab = q.shape
    removed = torch.zeros(s, vocab, dtype=torch.bool, device=q.device)
    r_idx = [r for r, t in enumerate(tried) for _ in t]
    if r_idx:
        removed[r_idx, [tok for t in tried for tok in t]] = True
    w = q.double().masked_fill(removed, 0.0)  # == relu(q - removed): removed holds q exactly
    # Rounding can leave no mass (every kept token drafted and rejected): fall back to q.
    w = torch.where(w.sum(-1, keepdim=True) > 0, w, q.double())
    cdf = w.cumsum(-1)
    x = u.to(q.device).double()[:, None] * cdf[:, -1:]  # [S, 1]
    # First index with cdf > x: zero-mass tokens (filtered or removed) are never chosen.
    return torch.searchsorted(cdf, x, right=True)[:, 0].clamp_max(vocab - 1).tolist()


def _logprobs(logits: torch.Tensor, paths: list[list[int]],
              tokens: list[list[int]]) -> list[list[float]]:
    """log_softmax of the raw logits at the node that produced each committed token."""
    b_idx = [b for b, t in enumerate(tokens) for _ in t]
    nodes = [node for p in paths for node in p]  # tokens[b][j] is produced at node paths[b][j]
    toks = [tok for t in tokens for tok in t]
    logp = logits.log_softmax(-1)[b_idx, nodes, toks].tolist()
    out, start = [], 0
    for t in tokens:
        out.append(logp[start:start + len(t)])
        start += len(t)
    return out
