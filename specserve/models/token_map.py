"""FR-Spec token maps (`--speculative-token-map`): the draft's hot vocabulary.

The file is `torch.save(list_of_token_ids)` (or a 1-D tensor), usually sorted by
descending frequency. The draft's lm_head is truncated to those rows and its logit index
i means target token ids[i]; verification still uses the full vocabulary, so a token map
changes acceptance, never correctness. Local files only: nothing is downloaded. An EAGLE-2
head truncates the target's head it shares (models/draft_model.py `share`); a STANDALONE
draft LLM its own (`truncate_head`), its embedding staying whole (it reads any token).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from specserve.core import parallel

if TYPE_CHECKING:
    from specserve.models.llama import LlamaForCausalLM


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """Token ids [n] int64 (CPU), checked unique and within [0, vocab_size)."""
    if not Path(path).is_file():
        raise ValueError(f"speculative token map {path} does not exist: specserve does not download "
                         "token maps, give a local path to the .pt file")
    ids = torch.load(path, weights_only=True)
    try:
        ids = torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"token map {path} is not a list of token ids: {e}") from None
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"token map {path} must hold integer token ids, got {ids.dtype}")
    ids = ids.to(torch.int64)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"token map {path} must be a non-empty 1-D list of token ids, got shape {tuple(ids.shape)}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"token map {path} has ids outside the vocabulary [0, {vocab_size}): "
                         f"min {ids.min().item()}, max {ids.max().item()}")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"token map {path} has repeated token ids")
    return ids


def cut_head(weight: torch.Tensor, ids: torch.Tensor) -> tuple[nn.Linear, torch.Tensor]:
    """(an lm_head of the rows `ids` of `weight` [V, H], a copy; `ids` on its device)."""
    ids = ids.to(weight.device)
    head = nn.Linear(weight.shape[1], ids.numel(), bias=False, device="meta")
    head.weight = nn.Parameter(weight.detach()[ids], requires_grad=False)  # [len(ids), H]
    return head, ids


def truncate_head(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Cut a draft LLM's lm_head (models/llama.py `LlamaForCausalLM`) to the rows `ids`, a
    copy (a tied embedding keeps its whole table): its logit i then means token ids[i]. A
    head served in a GGUF's blocks is served from the cut float rows instead (the float
    head stays beside the blocks: models/gguf_serve.py). Returns `ids` on the model's
    device, for the drafter to map its picks back."""
    if parallel.tp_size() > 1:
        raise ValueError("--speculative-token-map with a STANDALONE draft is not supported at --tp-size > 1 "
                         "(the draft's lm_head is split over the ranks by vocabulary)")
    weight = model.lm_head.weight.detach()
    if not weight.is_floating_point() or weight.is_meta or weight.shape[0] <= int(ids.max()):
        raise ValueError(f"--speculative-token-map: the draft's lm_head ({tuple(weight.shape)}, {weight.dtype}) "
                         "cannot be truncated to the map's token ids")
    model.lm_head, ids = cut_head(weight, ids)
    model.head_blocks = None  # a GGUF's head blocks (the float head stays beside them): the cut rows serve
    return ids
