"""FR-Spec token maps (`--speculative-token-map`): the draft's hot vocabulary.

The file is `torch.save(list_of_token_ids)` (or a 1-D tensor), usually sorted by
descending frequency. The draft's lm_head is truncated to those rows and its logit index
i means target token ids[i]; verification still uses the full vocabulary, so a token map
changes acceptance, never correctness. Local files only: nothing is downloaded.
"""
from __future__ import annotations

from pathlib import Path

import torch


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
