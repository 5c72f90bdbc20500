"""ScheduleBatch: the scheduler's CPU-side description of one forward.

The scheduler decides which requests run and how many new tokens each contributes and
has already allocated their slots; `ModelRunner` turns this into a device ForwardBatch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.request import Req
from specserve.runner.forward_batch import ForwardMode
from specserve.runner.sampler import SamplingBatch


@dataclass
class ScheduleBatch:
    mode: ForwardMode
    reqs: list[Req]
    input_ids: list[int]  # packed new tokens, request by request
    out_slots: torch.Tensor  # [T] slots of the new tokens
    prefix_lens: list[int]  # KV length of each request before this forward
    extend_lens: list[int]
    sample_mask: list[bool]  # which requests get a next token from this forward
    # Speculative verify: explicit positions (seq_len + depth), tree masks over each
    # request's new tokens, and logits for every new token instead of the last ones.
    positions: list[int] | None = None
    custom_masks: list[torch.Tensor] | None = None
    all_logits: bool = False
    rows: list[int] | None = None  # table rows to read KV from, when not the requests' own

    @property
    def sampled_reqs(self) -> list[Req]:
        return [r for r, s in zip(self.reqs, self.sample_mask) if s]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def sampling_batch(reqs: list[Req], vocab_size: int, device: torch.device) -> SamplingBatch:
    """Stack the requests' sampling parameters into [B] tensors."""
    def t(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=device)

    ps = [r.params for r in reqs]
    top_k = [p.top_k if p.top_k and p.top_k > 0 else vocab_size for p in ps]
    return SamplingBatch(
        temperature=t([p.temperature for p in ps]), greedy=t([p.greedy for p in ps], torch.bool),
        top_p=t([p.top_p for p in ps]), top_k=t(top_k, torch.int64), min_p=t([p.min_p for p in ps]),
        freq_penalty=t([p.frequency_penalty for p in ps]),
        presence_penalty=t([p.presence_penalty for p in ps]),
        seeds=t([r.seed for r in reqs], torch.int64),
        counters=t([len(r.output_ids) for r in reqs], torch.int64),
        output_ids=[r.output_ids for r in reqs],
        top_logprobs=max((p.top_logprobs for p in ps if p.logprobs), default=0),
        want_logprobs=any(p.logprobs for p in ps),
    )
