"""Scheduler counters, the periodic SGLang-shaped log lines, and the /metrics snapshot."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("specserve")


@dataclass
class SchedulerStats:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    cached_tokens_total: int = 0
    requests_total: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    retractions_total: int = 0
    decode_steps: int = 0
    gen_throughput: float = 0.0
    _window_tokens: int = 0
    _window_start: float = field(default_factory=time.monotonic)

    def on_prefill(self, new_seqs: int, new_tokens: int, cached: int, usage: float,
                   running: int, queued: int) -> None:
        logger.info("Prefill batch, #new-seq: %d, #new-token: %d, #cached-token: %d, "
                    "token usage: %.2f, #running-req: %d, #queue-req: %d",
                    new_seqs, new_tokens, cached, usage, running, queued)

    def on_decode(self, new_tokens: int, interval: int, running: int, kv_tokens: int,
                  usage: float, queued: int, cuda_graph: bool,
                  spec: tuple[float | None, int] | None = None) -> None:
        """`spec`: (accept length over the window, draft tokens per verify) when speculating."""
        self.decode_steps += 1
        self._window_tokens += new_tokens
        if self.decode_steps % interval:
            return
        now = time.monotonic()
        self.gen_throughput = self._window_tokens / max(now - self._window_start, 1e-9)
        self._window_tokens, self._window_start = 0, now
        accept = ""
        if spec is not None and spec[0] is not None:  # SGLang: accept rate = accept len / N
            accept = f"accept len: {spec[0]:.2f}, accept rate: {spec[0] / spec[1]:.2f}, "
        logger.info("Decode batch, #running-req: %d, #token: %d, token usage: %.2f, %s"
                    "cuda graph: %s, gen throughput (token/s): %.2f, #queue-req: %d",
                    running, kv_tokens, usage, accept, cuda_graph, self.gen_throughput, queued)
