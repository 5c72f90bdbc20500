"""The objective: per TTT step, soft cross-entropy to the target's next-token distribution
(EAGLE-2 adds regression onto the target's next feature), weighted `decay ** j`; and the
per-step top-1 accuracy that stands in for acceptance.

Row bookkeeping. `rows[b, k]` is True when row k's distribution is a real answer token's
(k + 1 is an answer position and k + 1 < n). Step j at index i predicts token i + 2 + j,
whose distribution is row k = i + 1 + j, so step j is scored at the indices i where
rows[b, i + 1 + j] holds. EAGLE-3 (as SpecForge): the target distribution is
renormalised over the draft vocabulary, and rows whose target argmax is outside it carry
no cross-entropy (they cannot be predicted) but still count as misses in the accuracy.
Losses are means over a step's scored rows; accuracy = draft argmax (as a target id) ==
target argmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.models.draft_model import DraftModel
from specserve.train.features import Taught


@dataclass
class StepStats:
    loss: float  # this step's unweighted loss
    acc: float  # top-1 agreement with the target over this step's rows
    rows: int


class Objective:
    def __init__(self, draft: DraftModel, decay: float = 0.8, feature_loss: bool = False,
                 ce_weight: float = 1.0) -> None:
        """feature_loss: EAGLE-2's smooth-L1 regression onto the next feature (with the
        cross-entropy weighted `ce_weight`, 0.1 in EAGLE-1/2's recipe)."""
        self.draft, self.decay = draft, decay
        self.feature_loss, self.ce_weight = feature_loss, ce_weight
        ids = None
        if draft.owns_lm_head:  # a head with its own lm_head (EAGLE-3) registers its d2t offsets
            d2t = draft.get_buffer("d2t")
            ids = d2t + torch.arange(d2t.numel(), device=d2t.device)
        self.token_map = ids  # draft index -> target id (None: identity)
        self.in_vocab: torch.Tensor | None = None
        if ids is not None:
            assert draft.embed_tokens is not None  # `share` attached the target's embedding
            self.in_vocab = torch.zeros(draft.embed_tokens.num_embeddings, dtype=torch.bool, device=ids.device)
            self.in_vocab[ids] = True

    def __call__(self, outs: list[tuple[torch.Tensor, torch.Tensor]],
                 taught: Taught) -> tuple[torch.Tensor, list[StepStats]]:
        """outs: `draft.unroll`'s (h_logits, h_next) per step. Returns (weighted total, stats)."""
        total = torch.zeros((), device=taught.probs.device)
        losses, accs, counts = [], [], []
        for j, (h_logits, h_next) in enumerate(outs):
            loss, acc, n = self._step(j, h_logits, h_next, taught)
            total = total + self.decay ** j * loss
            losses.append(loss.detach())
            accs.append(acc)
            counts.append(n)
        values = torch.stack(losses + accs).tolist()  # one device sync for every statistic
        steps = len(outs)
        return total, [StepStats(values[j], values[steps + j], counts[j]) for j in range(steps)]

    def _step(self, j: int, h_logits: torch.Tensor, h_next: torch.Tensor,
              taught: Taught) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(loss, accuracy, scored rows) of step j."""
        b_idx, i_idx = scored_indices(taught.row_index >= 0, j)
        k_idx = i_idx + 1 + j  # the target row each scored index predicts
        if b_idx.numel() == 0:
            zero = h_logits.sum() * 0
            return zero, zero.detach(), 0
        logits = self.draft.compute_logits(h_logits[b_idx, i_idx])  # [N, V'] float32
        r = taught.row_index[b_idx, k_idx]
        target, top = taught.probs[r], taught.top[r]
        ce = -(target * torch.log_softmax(logits, dim=-1)).sum(-1)  # [N]
        if self.in_vocab is not None:
            ce = ce * self.in_vocab[top]
        loss = ce.mean()
        if self.feature_loss:
            feature = taught.features[b_idx, k_idx].float()
            loss = self.ce_weight * loss + F.smooth_l1_loss(h_next[b_idx, i_idx].float(), feature)
        with torch.no_grad():
            guess = logits.argmax(-1)
            if self.token_map is not None:
                guess = self.token_map[guess]
            acc = (guess == top).float().mean()
        return loss, acc, b_idx.numel()


def scored_indices(rows: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, index) of every index i of step j whose target row i + 1 + j is scored."""
    shift = 1 + j
    scored = torch.zeros_like(rows)
    if shift < rows.shape[1]:
        scored[:, :rows.shape[1] - shift] = rows[:, shift:]
    b_idx, i_idx = scored.nonzero(as_tuple=True)  # rows is [B, T]: one index tensor per dimension
    return b_idx, i_idx


def answer_rows(lengths: torch.Tensor, prompt_lens: torch.Tensor, seqlen: int) -> torch.Tensor:
    """[B, T] bool: rows k with prompt_len - 1 <= k <= n - 2 (row k's next token is a
    real answer token)."""
    k = torch.arange(seqlen, device=lengths.device)[None, :]
    return (k >= prompt_lens[:, None] - 1) & (k <= lengths[:, None] - 2)
