"""Batched token sampling: temperature, top-k, top-p, min-p, seeds, logprobs.

Penalties, logit bias and grammar masks are not here: they change the logits before
sampling (runner/logits_process.py), the same way for plain and speculative steps.

Randomness is counter-based: the uniform noise for request b, vocabulary entry v at its
n-th output token is a hash of (seed_b, n, v). So a request's samples depend only on its
own seed and progress, never on which other requests share the batch, and the whole
batch samples with tensor ops (no per-request loop, CPU or GPU). Sampling is Gumbel-max:
argmax(logits / T + Gumbel noise) draws exactly from softmax(logits / T) restricted to
the tokens the filters keep.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve import kernels
from specserve.core.request import Req
from specserve.kernels import cpu_rows

_LOG2E = 1.4426950408889634
_M1, _M2 = 0x7FEB352D, 0x2C1B3C6D  # odd multipliers < 2**31: products stay inside int64
_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply) on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] float32 uniforms in (0, 1), a pure function of (seed, counter, column).
    23 bits of the hash: (k + 0.5) / 2**23 is exact in float32 and never rounds to 1, whose
    Gumbel noise would be +inf (and NaN on a token a grammar masked to -inf)."""
    col = torch.arange(width, device=seeds.device, dtype=torch.int64)[None, :]
    h = _mix32((seeds[:, None] & _MASK32) ^ _mix32(seeds[:, None] >> 32))
    h = _mix32(h ^ _mix32(counters[:, None] & _MASK32))
    h = _mix32(h ^ col)
    return ((h >> 9).float() + 0.5) / float(1 << 23)


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] float32 Gumbel(0, 1) noise, -log(-log(uniform_noise(...))): one Triton
    launch on a GPU (kernels/gumbel.py), these torch ops elsewhere. Every sampled path
    draws its noise here, so plain and speculative sampling agree under a seed."""
    if kernels.use_fused(seeds):
        return kernels.gumbel_noise(seeds, counters, width)
    return -torch.log(-torch.log(uniform_noise(seeds, counters, width)))


@dataclass(frozen=True)
class HostFlags:
    """Batch-wide decisions known on the host when the batch is built, so that sampling
    needs no device->host sync to choose its path (on a GPU each would stall the step)."""

    all_greedy: bool
    needs_sort: bool  # some request limits top-k or top-p
    needs_min_p: bool


@dataclass
class SamplingBatch:
    """Per-request sampling parameters as [B] tensors on the logits' device."""

    temperature: torch.Tensor  # float32; rows with greedy=True ignore it
    greedy: torch.Tensor  # bool
    top_p: torch.Tensor
    top_k: torch.Tensor  # int64, vocab size when unlimited
    min_p: torch.Tensor
    seeds: torch.Tensor  # int64
    counters: torch.Tensor  # int64: index of the token being sampled within the output
    top_logprobs: int = 0  # max over the batch; 0 and want_logprobs False: skip
    want_logprobs: bool = False
    flags: HostFlags | None = None  # None: decide from the tensors (a sync on GPU)

    @property
    def all_greedy(self) -> bool:
        return self.flags.all_greedy if self.flags else bool(self.greedy.all())

    def needs_sort(self, vocab: int) -> bool:
        return self.flags.needs_sort if self.flags else bool((self.top_k < vocab).any() | (self.top_p < 1.0).any())

    @property
    def needs_min_p(self) -> bool:
        return self.flags.needs_min_p if self.flags else bool((self.min_p > 0).any())


@dataclass
class SampleOutput:
    next_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] log p(chosen) under the model distribution
    top_ids: torch.Tensor | None = None  # [B, K]
    top_logprobs: torch.Tensor | None = None  # [B, K]


def temperatures(sb: SamplingBatch) -> torch.Tensor:
    """[B] the divisor of each row's logits: its temperature (1 for greedy rows), >= 1e-5."""
    return torch.where(sb.greedy, 1.0, sb.temperature).clamp_min(1e-5)


def filtered(sb: SamplingBatch, vocab: int) -> bool:
    """Whether some request of `sb` limits top-k, top-p or min-p."""
    return sb.needs_sort(vocab) or sb.needs_min_p


def filter_floors(logits: torch.Tensor, sb: SamplingBatch, per_request: int = 1) -> torch.Tensor:
    """[R] float32: the smallest logit each row of logits [R, V] keeps (-inf: all of them),
    row r under request r // per_request's params. The filters keep an upper set of the
    logits (kernels/filters.py says which): top-k and top-p on the whole vocabulary's
    softmax at the temperature, ties at the edge kept, and min-p. A few launches on a GPU,
    nothing sorted; here by sorting, the reference."""
    if kernels.use_fused(logits):  # greedy rows' floors, found at T -> 0, are never read
        return kernels.filter_floors(logits, sb.temperature, sb.top_k, sb.top_p, sb.min_p, per_request)
    t = temperatures(sb)
    if per_request > 1:
        t, top_k, top_p, min_p = (v.repeat_interleave(per_request) for v in (t, sb.top_k, sb.top_p, sb.min_p))
    else:
        top_k, top_p, min_p = sb.top_k, sb.top_p, sb.min_p
    x = logits.float()
    lmax = x.max(-1).values
    floor = torch.where(min_p > 0, lmax + t * torch.log(min_p), float("-inf"))
    has_k = top_k < (x > float("-inf")).sum(-1)
    has_p = top_p < 1.0
    if not bool((has_k | has_p).any()):
        return floor
    s = x.sort(-1, descending=True).values
    e = torch.exp2((s - lmax[:, None]) * (_LOG2E / t)[:, None])
    before = e.cumsum(-1) - e  # the mass ahead of each sorted logit
    rank = torch.arange(x.shape[-1], device=x.device)[None, :]
    ok = (rank < torch.where(has_k, top_k, x.shape[-1] + 1)[:, None]) \
        & (before < torch.where(has_p, top_p * e.sum(-1), float("inf"))[:, None])  # a prefix of each row
    kept = s.gather(1, (ok.sum(-1) - 1).clamp_min(0)[:, None]).squeeze(1)
    return torch.maximum(floor, torch.where(has_k | has_p, kept, float("-inf")))


def filter_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Temperature-scaled logits with -inf outside top-k, top-p and min-p."""
    scaled = logits / temperatures(sb)[:, None]
    if filtered(sb, logits.shape[-1]):
        scaled = scaled.masked_fill(logits < filter_floors(logits, sb)[:, None], float("-inf"))
    return scaled


def sample(logits: torch.Tensor, sb: SamplingBatch) -> SampleOutput:
    """logits [B, V] float32 (processed: logits_process.py) -> next tokens (and logprobs if
    any request asked)."""
    if sb.all_greedy:
        next_ids = cpu_rows.argmax(logits)  # torch's argmax, faster on a CPU
    elif kernels.use_fused(logits):
        # the same draw as below (the same noise, division, floors and first-index ties),
        # with no [B, V] noise or scaled logits stored and nothing sorted: two launches
        # (three with filters) where the torch ops take ~8 (~20)
        floors = filter_floors(logits, sb) if filtered(sb, logits.shape[-1]) else None
        next_ids = kernels.sampled_argmax(logits, kernels.Tempered(sb.temperature, sb.greedy, sb.seeds, sb.counters,
                                                                   floors=floors))
    else:
        scaled = filter_logits(logits, sb)
        sampled = (scaled + gumbel_noise(sb.seeds, sb.counters, logits.shape[-1])).argmax(-1)
        next_ids = torch.where(sb.greedy, logits.argmax(-1), sampled)
    out = SampleOutput(next_ids)
    if sb.want_logprobs:
        logp = logits.log_softmax(-1)
        out.logprobs = logp.gather(-1, next_ids[:, None]).squeeze(-1)
        if sb.top_logprobs:
            out.top_logprobs, out.top_ids = logp.topk(sb.top_logprobs, dim=-1)
    return out


def sampling_batch(reqs: list[Req], vocab_size: int, device: torch.device,
                   lag: list[int] | None = None) -> SamplingBatch:
    """Stack the requests' sampling parameters into [B] tensors: two host->device copies
    (floats, ints) and host-side flags, so sampling never syncs to pick its path.
    lag[b]: request b's tokens sampled but not yet committed (an overlapped step in
    flight), so its noise counter is that of the token actually being sampled."""
    ps = [r.params for r in reqs]
    if all(p.greedy and not p.logprobs for p in ps):
        return _greedy_batch(reqs, vocab_size, device)
    counters = [len(r.output_ids) + (lag[b] if lag else 0) for b, r in enumerate(reqs)]
    float_rows, int_rows = param_rows(reqs, vocab_size, counters)
    top_k = int_rows[0]
    floats = torch.tensor(float_rows, dtype=torch.float32).to(device, non_blocking=True)
    ints = torch.tensor(int_rows, dtype=torch.int64).to(device, non_blocking=True)
    flags = HostFlags(all_greedy=all(p.greedy for p in ps),
                      needs_sort=any(k < vocab_size for k in top_k) or any(p.top_p < 1.0 for p in ps),
                      needs_min_p=any(p.min_p > 0 for p in ps))
    return SamplingBatch(
        temperature=floats[0], top_p=floats[1], min_p=floats[2], greedy=floats[3] > 0,
        top_k=ints[0], seeds=ints[1], counters=ints[2],
        top_logprobs=max((p.top_logprobs for p in ps if p.logprobs), default=0),
        want_logprobs=any(p.logprobs for p in ps), flags=flags,
    )


def param_rows(reqs: list[Req], vocab_size: int, counters: list[int]) -> tuple[list[list], list[list[int]]]:
    """The requests' parameters as host rows: [temperature, top_p, min_p, greedy] floats and
    [top_k (vocab_size when off), seed, output index] ints."""
    ps = [r.params for r in reqs]
    return ([[p.temperature for p in ps], [p.top_p for p in ps], [p.min_p for p in ps], [float(p.greedy) for p in ps]],
            [[p.top_k if p.top_k and p.top_k > 0 else vocab_size for p in ps], [r.seed for r in reqs], counters])


_GREEDY: dict[tuple[int, int, torch.device], SamplingBatch] = {}  # (B, vocab, device) -> tensors


def _greedy_batch(reqs: list[Req], vocab_size: int, device: torch.device) -> SamplingBatch:
    """A batch of greedy requests without logprobs: sampling takes the argmax
    and reads none of the tensors, so they are built once per batch size (temperature 0,
    no filters, seeds and counters 0) instead of two host->device copies a step (a plain
    batch-1 step is bound by host work, of which the general path is a sizeable part)."""
    key = (len(reqs), vocab_size, device)
    if key not in _GREEDY:
        b = len(reqs)
        zeros = torch.zeros(b, dtype=torch.float32, device=device)
        ints = torch.zeros(b, dtype=torch.int64, device=device)
        _GREEDY[key] = SamplingBatch(
            temperature=zeros, top_p=torch.ones(b, device=device), min_p=zeros,
            greedy=torch.ones(b, dtype=torch.bool, device=device),
            top_k=torch.full((b,), vocab_size, dtype=torch.int64, device=device), seeds=ints, counters=ints,
            flags=HostFlags(all_greedy=True, needs_sort=False, needs_min_p=False))
    return _GREEDY[key]
