"""Per-request logits processors: logit bias, penalties and grammar masks, per tree node.

Owns the one function that turns a model's logits into the distribution each request
samples from, before temperature and filters (runner/sampler.py): plain decoding calls it
with one row per request, a speculative verify with one row per draft-tree node. Each
node's row is processed with the history of its own path: the request's prompt and
committed output plus the draft tokens of the node's ancestors and itself (the root is
the last committed token, already in the output). So a tree's accepted path sees exactly
what plain decoding would have seen at each of its positions, and speculation stays
lossless for the processed distribution. In order:

  1. logit_bias (OpenAI): logit[t] += bias[t].
  2. repetition_penalty (vLLM / Hugging Face): a token seen in the prompt, the output or
     the path has its logit divided by the penalty when positive, multiplied when not.
  3. frequency_penalty and presence_penalty (OpenAI): logit -= f * count + p * (count > 0),
     counting output and path tokens.
  4. the grammar mask: -inf on every token the request's matcher refuses at that node
     (not applied to a greedy request whose mask allows its argmax wherever its greedy
     walk goes: the masked argmax is then the same token; `_needing_masks`).

Logprobs are read from the processed logits, on both paths. Rows of requests without
processors are returned untouched (the tensor itself when no request has any).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from specserve.core.request import Req

_BITS = torch.arange(32, dtype=torch.int32)


@dataclass
class TreePaths:
    """A draft tree batch as the processors need it: host lists (for the grammar) and
    device tensors (for the counts). anc[b, i, j]: node j is node i or one of its ancestors."""

    tokens: list[list[int]]
    parents: list[list[int]]
    valid: list[list[bool]]
    tok: torch.Tensor  # [B, N] int64
    anc: torch.Tensor  # [B, N, N] bool, valid nodes only

    @classmethod
    def of(cls, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor,
           anc: torch.Tensor) -> TreePaths:
        return cls(tokens.tolist(), parents.tolist(), valid.bool().tolist(), tokens, anc & valid[:, None, :])


def process(logits: torch.Tensor, reqs: list[Req], tree: TreePaths | None = None) -> torch.Tensor:
    """logits [B, N, V] (N nodes a request; N = 1 and tree None for plain rows) ->
    the processed logits (a new tensor when any request has processors)."""
    rows = [b for b, r in enumerate(reqs) if r.params.processed]
    if not rows:
        return logits
    logits = logits.float().clone()  # may be a graph's output view or an inference tensor
    for b in rows:
        bias = reqs[b].params.logit_bias
        if bias:
            ids = torch.tensor(list(bias), device=logits.device)
            logits[b, :, ids] += torch.tensor(list(bias.values()), device=logits.device)
    penalized = [b for b in rows if reqs[b].params.penalized]
    if penalized:
        logits[penalized] = _penalize(logits[penalized], [reqs[b] for b in penalized], tree, penalized)
    constrained = _needing_masks(logits, reqs, [b for b in rows if reqs[b].grammar is not None], tree)
    if constrained:
        allowed = _grammar_allowed(reqs, constrained, tree, logits.shape[1], logits.shape[2], logits.device)
        logits[constrained] = logits[constrained].masked_fill(~allowed, float("-inf"))
    return logits


def _needing_masks(logits: torch.Tensor, reqs: list[Req], rows: list[int], tree: TreePaths | None) -> list[int]:
    """The constrained rows whose masks must be applied. A greedy request without logprobs
    reads only the argmaxes along its greedy walk; where its mask allows the unmasked
    argmax at each node of that walk, the masked argmax is the same token (masking only
    removes tokens), so its logits stay as they are: exact, and its masks are computed
    at the walk's nodes only."""
    fast = [b for b in rows if reqs[b].params.greedy and not reqs[b].params.logprobs]
    if not fast:
        return rows
    top = logits[fast].argmax(-1).tolist()  # [F, N]: one read-back
    keep = set()
    for b, t in zip(fast, top):
        g = reqs[b].grammar
        g.sync(reqs[b].output_ids)
        walk = (tree.tokens[b], tree.parents[b], tree.valid[b]) if tree is not None else (None, None, None)
        if g.greedy_walk_allowed(t, *walk):
            keep.add(b)
    return [b for b in rows if b not in keep]


def process_rows(logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    """Plain sampling's form: logits [B, V], one row per request."""
    if not any(r.params.processed for r in reqs):
        return logits
    return process(logits[:, None, :], reqs)[:, 0]


def _penalize(logits: torch.Tensor, reqs: list[Req], tree: TreePaths | None, rows: list[int]) -> torch.Tensor:
    """logits [R, N, V] of the penalized requests -> penalized."""
    r, n, vocab = logits.shape
    dev = logits.device
    out_counts = _counts([q.output_ids for q in reqs], vocab, dev)  # [R, V]
    path = torch.zeros(r, n, vocab, device=dev)
    if tree is not None and n > 1:  # each node's ancestors and itself, the root excepted
        idx = torch.tensor(rows, device=dev)
        tok, anc = tree.tok.to(dev)[idx], tree.anc.to(dev)[idx]
        path.scatter_add_(2, tok[:, None, 1:].expand(r, n, n - 1), anc[:, :, 1:].float())
    counts = out_counts[:, None, :] + path
    p = [q.params for q in reqs]
    rep = torch.tensor([x.repetition_penalty for x in p], device=dev)[:, None, None]
    if any(x.repetition_penalty != 1.0 for x in p):
        prompt = _counts([q.prompt_ids for q in reqs], vocab, dev)
        seen = (prompt[:, None, :] + counts) > 0
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    freq = torch.tensor([x.frequency_penalty for x in p], device=dev)[:, None, None]
    presence = torch.tensor([x.presence_penalty for x in p], device=dev)[:, None, None]
    return logits - freq * counts - presence * (counts > 0)


def _counts(ids: list[list[int]], vocab: int, dev: torch.device) -> torch.Tensor:
    """[R, V] float32 occurrences of each token in each list."""
    counts = torch.zeros(len(ids), vocab, device=dev)
    flat = [t for x in ids for t in x]
    if flat:
        row = torch.tensor([i for i, x in enumerate(ids) for _ in x], device=dev)
        counts.index_put_((row, torch.tensor(flat, device=dev)), torch.ones(len(flat), device=dev), accumulate=True)
    return counts


def _grammar_allowed(reqs: list[Req], rows: list[int], tree: TreePaths | None, n: int,
                     vocab: int, dev: torch.device) -> torch.Tensor:
    """[R, N, V] bool: the tokens each constrained request's grammar allows at each node.
    Requests' matchers are independent and llguidance computes a mask without the GIL, so
    several requests' masks are computed on a thread pool."""
    def masks_of(b: int) -> torch.Tensor:
        g = reqs[b].grammar
        g.sync(reqs[b].output_ids)
        if tree is None:
            return g.mask()[None]
        return g.tree_masks(tree.tokens[b], tree.parents[b], tree.valid[b])

    masks = list(_pool().map(masks_of, rows)) if len(rows) > 1 else [masks_of(rows[0])]
    words = torch.stack(masks)  # [R, N, W] int32
    if dev.type == "cpu":  # numpy's unpackbits (little-endian words): one pass, where shifts take several
        bits = np.unpackbits(words.numpy().view(np.uint8), axis=-1, bitorder="little")
        return torch.from_numpy(bits[..., :vocab]).bool()
    words = words.to(dev, non_blocking=True)  # V/32 words a row cross to the device
    return ((words[..., None] >> _BITS.to(dev)) & 1).reshape(len(rows), n, -1)[..., :vocab].bool()


@cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="masks")
