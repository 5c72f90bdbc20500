"""GPU memory sizing: SGLang's automatic --mem-fraction-static and its OOM advice.

The KV cache takes what is left of `total * mem_fraction_static` once the weights are
loaded. When the fraction is omitted it is computed as SGLang does (internals note 2.5):
headroom for activations (by chunked-prefill size), CUDA graphs (by their max batch
size), at least 10 GB on large GPUs, and more for a draft model: the draft's weights and
its KV pool (same slot count, its own layers) must fit in that headroom.

It also settles the KV pool's storage dtype (--kv-cache-dtype), which sets the bytes a
slot takes: an fp8 pool fits twice the slots of a 16-bit one in the same memory.
"""
from __future__ import annotations

import torch

from specserve.cache.kv_pool import KV_CACHE_DTYPES
from specserve.core.config import ConfigError

MB = 1 << 20
FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper convert to and from fp8 in hardware

OOM_ADVICE = (
    "out of GPU memory at start-up; try, in this order: a lower --mem-fraction-static, a smaller "
    "--cuda-graph-max-bs, a smaller draft tree (--speculative-num-steps / --speculative-eagle-topk / "
    "--speculative-num-draft-tokens), a lower --max-running-requests (or set --max-total-tokens)"
)


def auto_mem_fraction(total_bytes: int, chunked_prefill_size: int | None, cuda_graph_max_bs: int | None,
                      draft_headroom_mb: int = 0) -> float:
    """The fraction of GPU memory for weights + KV cache when --mem-fraction-static is
    omitted; `draft_headroom_mb` is what the speculative algorithm asks to keep back
    (spec/registry.py: 6 GiB for a draft LLM, 2 GiB for an EAGLE head, none for NGRAM)."""
    total_mb = total_bytes / MB
    reserved = 512 + max(chunked_prefill_size or 0, 2048) * 1.5 + (cuda_graph_max_bs or 256) * 2
    if total_mb > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    reserved += draft_headroom_mb
    return (total_mb - reserved) / total_mb


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pool's dtype for --kv-cache-dtype `name` (args_check.py has checked the name):
    the model's for "auto"; an fp8 one on the CPU or on a GPU of compute capability 8.9+."""
    if name == "auto":
        return model_dtype
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < FP8_MIN_CAPABILITY:
            raise ConfigError(f"--kv-cache-dtype {name} needs a GPU of compute capability 8.9 or newer; "
                              f"this one has {cap[0]}.{cap[1]} (use --kv-cache-dtype auto)")
    return KV_CACHE_DTYPES[name]
