"""Seeded sampling of a decode step as one CUDA graph replay per captured batch size.

At batch 1 a plain decode step is bound by its host work. Sampling on the GPU is a few
Triton launches (the filters' floors, kernels/filters.py; the draw's chunk maxima and
pick, kernels/argmax.py), and each launch costs the host more than the GPU takes to run
it. Here each captured size g samples rows [0:g] of the decode graph's static logits
with parameters held in static buffers: a step writes its requests' parameters (two
copies, none when its requests are the last step's) and replays one graph.

Invariants:
  * the captured body is `runner.sampler.sample` over a SamplingBatch of the static
    buffers, the eager fused path itself, so a replay draws the tokens eager sampling
    would draw (the filters' floors always run: a row without filters costs programs
    that read its parameters, and one that stores -inf);
  * padding rows [b:g] are greedy with no filters; their tokens are dropped;
  * only logits that are the decode graph's own rows are sampled here (processed logits,
    logprobs and all-greedy batches take the eager path: `covers`);
  * the returned ids are a copy: the static output is rewritten by the next replay,
    while a proposer may still hold the last step's ids;
  * a replay adds one to the static output indices (the noise counters), so a step whose
    requests are the last step's, each one token further, writes nothing to the device:
    the host checks the very objects and their counters (`_unchanged`), and any other
    step rewrites every column it replays.
"""
from __future__ import annotations

import bisect

import torch

from specserve.core.request import Req
from specserve.runner.cuda_graph import capture_each
from specserve.runner.sampler import HostFlags, SampleOutput, SamplingBatch, param_rows, sample

_EVERY_FILTER = HostFlags(all_greedy=False, needs_sort=True, needs_min_p=True)


class SampleGraphs:
    def __init__(self, logits: torch.Tensor, sizes: list[int], capture: bool = True) -> None:
        """`logits` [max_bs, V]: the decode graph's static logits; `sizes`: its captured
        batch sizes; `capture` False runs the same body eagerly (CPU tests)."""
        self.logits, self.sizes, self.capture = logits, sizes, capture
        max_bs, dev = sizes[-1], logits.device
        self.floats = torch.zeros(4, max_bs, dtype=torch.float32, device=dev)  # as sampler.param_rows
        self.ints = torch.zeros(3, max_bs, dtype=torch.int64, device=dev)  # as sampler.param_rows
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.out: dict[int, torch.Tensor] = {}
        self._last: tuple[int, list[Req], list[int]] = (0, [], [])  # size, requests, next counters
        if capture:
            self._fill([], [], sizes[-1])  # every row a padding row while capturing
            with torch.inference_mode():
                self.graphs, self.out = capture_each(sizes, self._draw, dev, desc="Capturing sampling graphs")

    def covers(self, logits: torch.Tensor, sb_greedy: bool, logprobs: bool) -> bool:
        """Whether a replay can sample `logits`: rows [0:b] of the static logits, seeded
        sampling (all-greedy batches take one argmax), no logprobs."""
        return not sb_greedy and not logprobs and logits.data_ptr() == self.logits.data_ptr() \
            and logits.shape[0] <= self.sizes[-1]

    def sample(self, reqs: list[Req], lag: list[int] | None = None) -> SampleOutput:
        """The next token of each of `reqs` (rows [0:b] of the static logits); lag as in
        `runner.sampler.sampling_batch` (tokens sampled but not yet committed)."""
        b = len(reqs)
        g = self.sizes[bisect.bisect_left(self.sizes, b)]
        counters = [len(r.output_ids) + (lag[i] if lag else 0) for i, r in enumerate(reqs)]
        if not self._unchanged(g, reqs, counters):
            self._fill(reqs, counters, g)
        self._last = (g, list(reqs), [c + 1 for c in counters])
        if not self.capture:
            return SampleOutput(self._draw(g)[:b].clone())
        self.graphs[g].replay()
        return SampleOutput(self.out[g][:b].clone())

    def _unchanged(self, g: int, reqs: list[Req], counters: list[int]) -> bool:
        """Whether the static buffers already hold this step: the last replay was of size g
        over these very request objects (held, so no new object can take their place), and
        each counter is one past the last (the replay's own increment)."""
        size, last, expected = self._last
        return size == g and len(last) == len(reqs) and all(a is b for a, b in zip(last, reqs)) \
            and counters == expected

    def _fill(self, reqs: list[Req], counters: list[int], g: int) -> None:
        """Write the requests' parameters to the static buffers' first g columns (padding: greedy)."""
        vocab, pad = self.logits.shape[1], g - len(reqs)
        float_rows, int_rows = param_rows(reqs, vocab, counters)
        floats = [row + [fill] * pad for row, fill in zip(float_rows, (0.0, 1.0, 0.0, 1.0))]
        ints = [row + [fill] * pad for row, fill in zip(int_rows, (vocab, 0, 0))]
        self.floats[:, :g].copy_(torch.tensor(floats, dtype=torch.float32), non_blocking=True)
        self.ints[:, :g].copy_(torch.tensor(ints, dtype=torch.int64), non_blocking=True)

    def _draw(self, g: int) -> torch.Tensor:
        """The captured body: sample rows [0:g] under the static parameters."""
        temperature, top_p, min_p, greedy = self.floats[:, :g]
        top_k, seeds, counters = self.ints[:, :g]
        sb = SamplingBatch(temperature=temperature, greedy=greedy > 0, top_p=top_p, top_k=top_k, min_p=min_p,
                           seeds=seeds, counters=counters, flags=_EVERY_FILTER)
        next_ids = sample(self.logits[:g], sb).next_ids
        counters.add_(1)  # the next step's index, unless the host rewrites it (`_unchanged`)
        return next_ids
