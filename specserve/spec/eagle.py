"""EAGLE-2, EAGLE-3 and MTP drafting: a draft head fed the target's own features.

Pairing (EAGLE's training layout, internals note 1.2): draft position p consumes the
target's feature at p (its final normed hidden, or EAGLE-3's auxiliary states) together
with token p+1, and predicts token p+2. The draft's KV for position p therefore needs
the token *after* p, which is why the root (last committed token, position kv_len) pairs
with the feature at kv_len - 1.

Draft KV invariant: between steps, every position < kv_len of a running request holds
draft KV computed from the target's true features, in the same slot as its target KV
(one slot index addresses both pools). It is kept eagerly:
  * `on_extend`: after each target prefill chunk [s, e), a DRAFT_EXTEND over the same
    slots pairs feature p with token p+1 (the next prompt token, or for the final chunk
    the token just sampled; SGLang PR 26329 is the chunked-prefill bug this avoids);
  * `on_verified`: after verify, a DRAFT_EXTEND over the committed positions pairs each
    accepted node's feature with the token committed after it.
Because a finished request's slots go to the prefix cache with their draft KV, a later
request that borrows them finds valid draft KV; only the last borrowed position could
have been paired with a different next token, so the KV manager recomputes it
(`prefix_backoff`).

Each extend's last position gives the root state: the draft's top-k children of the
root and the hidden that their depth-1 forwards take. `propose` expands trees from it
with `TreeDrafter` (shift 1: depth-d nodes at position kv_len + d - 1). Drafting is
deterministic top-k, so verification stays lossless for sampling.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specserve.cache.kv_pool import KVPool
from specserve.config import SpecConfig
from specserve.engine.batch import ScheduleBatch
from specserve.engine.kv_manager import KVManager
from specserve.engine.request import Req
from specserve.models.draft_loader import load_draft
from specserve.models.mtp import has_mtp_layers
from specserve.models.source import resolve_model_dir
from specserve.models.token_map import load_token_map
from specserve.runner.forward_batch import ForwardMode
from specserve.runner.h2d import h2d
from specserve.runner.model_runner import ModelRunner, make_backend
from specserve.spec.draft_graphs import DraftDecodeGraphs
from specserve.spec.drafts import Drafts
from specserve.spec.proposer import Verified
from specserve.spec.tree_draft import TreeDrafter, top_children

logger = logging.getLogger("specserve")


@dataclass
class RootState:
    """A request's draft output at its last draft-KV position (kv_len - 1)."""

    logp: torch.Tensor  # [k] log-probabilities of the root's best children
    ids: torch.Tensor  # [k] their target token ids
    hidden: torch.Tensor  # [H] the draft hidden the depth-1 forwards take


def extend_tokens(all_ids: list[int], start: int, end: int) -> list[int]:
    """The tokens paired with features [start, end): each position's *next* token."""
    return all_ids[start + 1:end + 1]


class EagleProposer:
    def __init__(self, spec: SpecConfig, runner: ModelRunner, kv: KVManager, max_running: int) -> None:
        self.model = load_draft(_draft_dir(spec, runner), runner.model, spec.algorithm, runner.dtype,
                                runner.device, _token_map(spec, runner))
        runner.capture_features(self.model.feature_mode, self.model.aux_layers)
        c = self.model.config
        self.pool = KVPool(runner.num_slots, c.num_layers, c.num_kv_heads, c.head_dim, runner.dtype, runner.device)
        self.backend = make_backend(spec.draft_attention_backend or runner.attn_backend_name, runner.device)
        self.runner, self.kv = runner, kv
        self.topk, self.max_nodes = spec.eagle_topk, spec.num_draft_tokens
        self.scratch_per_req = spec.eagle_topk * (spec.num_steps - 1)
        token_map = self.model.token_map
        self.token_map = token_map.to(runner.device) if token_map is not None else None
        self.tree = TreeDrafter(kv, self._step, spec.eagle_topk, spec.num_steps, shift=1, token_map=self.token_map)
        self.roots: dict[str, RootState] = {}
        self.graphs = self._capture(runner, max_running) if spec.num_steps > 1 else None

    # -- request life cycle -------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        assert req.rid in self.roots, "on_extend runs for a request's final prefill chunk first"

    def remove_request(self, req: Req) -> None:
        self.roots.pop(req.rid, None)

    # -- keeping the draft KV in sync -----------------------------------------------------
    def on_extend(self, batch: ScheduleBatch, features: torch.Tensor | None) -> None:
        """Draft-extend the chunk the target just prefilled, over the same slots."""
        ids = []
        for req, start, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            ids += extend_tokens(req.all_ids, start, start + n)
        draft = ScheduleBatch(ForwardMode.DRAFT_EXTEND, batch.reqs, ids, batch.out_slots,
                              batch.prefix_lens, batch.extend_lens, batch.sample_mask)
        self._set_roots(batch.sampled_reqs, *self._step(draft, features))

    def on_verified(self, reqs: list[Req], verified: Verified) -> None:
        """Draft-extend each request's committed positions with the target's features there."""
        ids, starts, lens, nodes = [], [], [], []
        n = verified.features.shape[1]
        for b, (req, tokens) in enumerate(zip(reqs, verified.committed)):
            start = req.kv_len - len(tokens)  # commit already advanced kv_len
            ids += extend_tokens(req.all_ids, start, req.kv_len)  # == the committed tokens
            starts.append(start)
            lens.append(len(tokens))
            nodes += [b * n + i for i in verified.paths[b][:len(tokens)]]
        feats = verified.features.reshape(-1, verified.features.shape[-1])
        feats = feats[h2d(nodes, feats.device)]  # [sum(lens), F]: the accepted nodes' features
        draft = ScheduleBatch(ForwardMode.DRAFT_EXTEND, reqs, ids, torch.cat(verified.kv_slots), starts, lens,
                              [True] * len(reqs))
        self._set_roots(reqs, *self._step(draft, feats))

    def _set_roots(self, reqs: list[Req], logits: torch.Tensor, hidden: torch.Tensor) -> None:
        logp, ids = top_children(logits, self.topk, self.token_map)
        for b, req in enumerate(reqs):
            self.roots[req.rid] = RootState(logp[b], ids[b], hidden[b])

    # -- drafting -------------------------------------------------------------------------
    def propose(self, reqs: list[Req], budgets: list[int]) -> Drafts:
        active = [b for b, n in enumerate(budgets) if n > 1]  # budget 1: root only (penalties)
        if not active:
            return Drafts.roots([r.all_ids[-1] for r in reqs], self.runner.device)
        act = [reqs[b] for b in active]
        roots = [self.roots[r.rid] for r in act]
        first = (torch.stack([s.logp for s in roots]), torch.stack([s.ids for s in roots]))
        tree = self.tree.draft(act, first, self.max_nodes, torch.stack([s.hidden for s in roots]))
        if len(act) == len(reqs):
            return tree
        return Drafts.roots([r.all_ids[-1] for r in reqs], self.runner.device).with_rows(active, tree)

    def _capture(self, runner: ModelRunner, max_running: int) -> DraftDecodeGraphs | None:
        """Draft decode graphs on CUDA (unless --disable-cuda-graph) when the backend can."""
        if runner.device.type != "cuda" or runner.runner_cfg.disable_cuda_graph \
                or not self.backend.supports_cuda_graph:
            return None
        vocab = self.token_map.numel() if self.token_map is not None else runner.vocab_size
        with torch.inference_mode():
            return DraftDecodeGraphs(self.model, self.backend, self.pool, self.kv.table.table,
                                     max_running * self.topk, vocab)

    @torch.inference_mode()
    def _step(self, batch: ScheduleBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward: (logits [R, V_draft], next hidden [R, H]) at the batch's
        logit rows (the last token of each sampled request, or every decode row)."""
        fb = self.runner.forward_batch(batch, self.kv.table.table, kv_pool=self.pool)
        fb.attn_backend = self.backend
        if self.graphs is not None and self.graphs.can_run(fb):
            return self.graphs.replay(fb, hidden)
        self.backend.init_forward_metadata(fb)
        h_logits, h_next = self.model(fb, hidden)
        rows = fb.logit_rows
        return self.model.compute_logits(h_logits[rows]), h_next[rows]


def _draft_dir(spec: SpecConfig, runner: ModelRunner):
    if spec.draft_model_path is not None:
        return resolve_model_dir(spec.draft_model_path, spec.draft_model_revision, spec.draft_load_format or "auto")
    if not has_mtp_layers(runner.model_dir):
        raise ValueError(f"--speculative-algorithm {spec.algorithm} needs --speculative-draft-model-path: "
                         f"the target model has no MTP layers to draft with")
    logger.info("Drafting with the target's own MTP layers")
    return runner.model_dir


def _token_map(spec: SpecConfig, runner: ModelRunner) -> torch.Tensor | None:
    if spec.token_map is None or spec.algorithm == "EAGLE3":  # EAGLE3: warned at parse time
        return None
    return load_token_map(spec.token_map, runner.vocab_size)
