"""STANDALONE: a small LLM with the target's vocabulary drafts a chain (topk 1) or a tree.

The draft has its own KV pool addressed by the target's slots and table, so it needs no
allocation of its own. Per request it tracks `draft_kv_len`: positions below it hold
valid draft KV. Each step:
  1. one EXTEND forward catches the draft up over [draft_kv_len, kv_len] (the committed
     tokens it has not seen, then the root) and drafts d1 from the root's logits;
  2. num_steps - 1 DECODE forwards feed d1, d2, ... at positions kv_len + 1, ..., writing
     their KV into the verify slots of chain nodes 1, 2, ... (already in the table).
After verify the first min(committed, fed) chain nodes keep valid draft KV, because
accepted chain nodes stay at their positions. With topk > 1, `tree_draft.TreeDrafter`
expands the root's children on scratch slots (each branch attends to the request's row plus
its own ancestors); only the root's draft KV is kept. Drafting is greedy (argmax): verification
treats drafts as one-hot, which is what makes sampling lossless.
"""
from __future__ import annotations

import torch

from specserve.cache.kv_pool import KVPool
from specserve.config import SpecConfig
from specserve.engine.batch import ScheduleBatch
from specserve.engine.kv_manager import KVManager
from specserve.engine.request import Req
from specserve.models.loader import load_model, read_hf_config
from specserve.models.source import resolve_model_dir
from specserve.runner.forward_batch import ForwardMode
from specserve.runner.model_runner import ModelRunner
from specserve.spec.drafts import Drafts
from specserve.spec.proposer import Decoded, Verified
from specserve.spec.tree_draft import TreeDrafter, TreeStep, frontier_batch, top_children


class StandaloneProposer:
    def __init__(self, spec: SpecConfig, runner: ModelRunner, kv: KVManager) -> None:
        if spec.draft_model_quantization not in (None, "unquant"):
            raise ValueError(f"--speculative-draft-model-quantization {spec.draft_model_quantization} "
                             "is not supported yet (supported: unquant)")
        path = resolve_model_dir(spec.draft_model_path, spec.draft_model_revision, spec.draft_load_format or "auto")
        draft_vocab = read_hf_config(path)["vocab_size"]
        if draft_vocab != runner.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft_vocab}) differs from the target's "
                             f"({runner.vocab_size}): STANDALONE needs a draft with the same tokenizer")
        self.model = load_model(path, runner.dtype, runner.device)
        c = self.model.config
        self.pool = KVPool(runner.num_slots, c.num_layers, c.num_kv_heads, c.head_dim, runner.dtype, runner.device)
        self.runner, self.kv = runner, kv
        self.num_steps = spec.num_steps
        self.max_nodes = spec.num_draft_tokens
        self.tree = TreeDrafter(kv, self._tree_step, spec.eagle_topk, spec.num_steps) if spec.eagle_topk > 1 else None
        self.scratch_per_req = spec.eagle_topk * (spec.num_steps - 1) if self.tree else 0
        self.draft_kv_len: dict[str, int] = {}
        self._fed: dict[str, tuple[int, int]] = {}  # rid -> (kv_len at propose, chain nodes fed)

    def add_request(self, req: Req) -> None:
        self.draft_kv_len[req.rid] = 0  # a cached prefix may lack draft KV: recompute it

    def remove_request(self, req: Req) -> None:
        self.draft_kv_len.pop(req.rid, None)
        self._fed.pop(req.rid, None)

    def propose(self, reqs: list[Req], budgets: list[int]) -> Drafts:
        if self.tree is not None:
            return self._propose_tree(reqs, budgets)
        chains: list[list[int]] = [[] for _ in reqs]
        active = [b for b, n in enumerate(budgets) if n > 1]
        if active:
            last = self._logits(self._catch_up([reqs[b] for b in active])).argmax(-1).tolist()
            for b, tok in zip(active, last):
                chains[b].append(tok)
            for step in range(1, self.num_steps):
                live = [b for b in active if len(chains[b]) < budgets[b] - 1]
                if not live:
                    break
                for b, tok in zip(live, self._decode([reqs[b] for b in live], [chains[b][-1] for b in live], step)):
                    chains[b].append(tok)
        for b, req in enumerate(reqs):  # nodes fed = root + all drafts but the last
            self._fed[req.rid] = (req.kv_len, len(chains[b]))
        return Drafts.chains([r.last_id for r in reqs], chains)

    def _propose_tree(self, reqs: list[Req], budgets: list[int]) -> Drafts:
        """Tree drafts; only the root's draft KV (in its verify slot) survives the step."""
        active = [b for b, n in enumerate(budgets) if n > 1]
        for b, req in enumerate(reqs):
            self._fed[req.rid] = (req.kv_len, 1 if b in active else 0)
        roots = Drafts.roots([r.last_id for r in reqs], self.runner.device)
        if not active:
            return roots
        act = [reqs[b] for b in active]
        first = top_children(self._logits(self._catch_up(act)), self.tree.topk, None)
        tree = self.tree.draft(act, self.max_nodes, first)
        return tree if len(act) == len(reqs) else roots.with_rows(active, tree)

    def on_extend(self, batch: ScheduleBatch, features: torch.Tensor | None) -> None:
        pass  # the draft catches up lazily in propose()

    def on_verified(self, reqs: list[Req], verified: Verified) -> None:
        for req, tokens in zip(reqs, verified.committed):
            kv_len, fed = self._fed.pop(req.rid)
            if fed:
                self.draft_kv_len[req.rid] = kv_len + min(len(tokens), fed)

    def on_decoded(self, reqs: list[Req], step: Decoded) -> None:
        pass  # the draft catches up lazily in propose()

    def can_draft_ahead(self, bsz: int) -> bool:
        return False  # it catches up from host ids in propose()

    def _catch_up(self, reqs: list[Req]) -> ScheduleBatch:
        """EXTEND over each request's unseen committed tokens plus its root (logits at the root)."""
        ids, prefix, ext, slots = [], [], [], []
        for req in reqs:
            start = self.draft_kv_len[req.rid]
            ids += req.all_ids[start:req.kv_len + 1]
            prefix.append(start)
            ext.append(req.kv_len + 1 - start)
            slots.append(self.kv.table.read(req.row, start, req.kv_len + 1))
        return ScheduleBatch(ForwardMode.DRAFT_EXTEND, reqs, ids, torch.cat(slots), prefix, ext, [True] * len(reqs))

    def _decode(self, reqs: list[Req], tokens: list[int], step: int) -> list[int]:
        """Feed chain node `step` (draft token d_step) at position kv_len + step."""
        pos = [r.kv_len + step for r in reqs]
        slots = torch.cat([self.kv.table.read(r.row, p, p + 1) for r, p in zip(reqs, pos)])
        batch = ScheduleBatch(ForwardMode.DECODE, reqs, tokens, slots, pos, [1] * len(reqs), [True] * len(reqs))
        return self._logits(batch).argmax(-1).tolist()

    @torch.inference_mode()
    def _tree_step(self, frame: TreeStep, states: None) -> tuple[torch.Tensor, None]:
        fb = frontier_batch(frame, self.kv.table.table, self.pool, self.runner.attn_backend)
        hidden, _ = self.model(fb)
        return self.model.compute_logits(hidden), None

    def _logits(self, batch: ScheduleBatch) -> torch.Tensor:
        fb = self.runner.forward_batch(batch, self.kv.table.table, kv_pool=self.pool)
        return self.runner.forward(fb, model=self.model)
