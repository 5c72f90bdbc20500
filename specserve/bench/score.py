"""Next-token distributions at every position of a sequence, for `bench quality`'s KL.

`position_logprobs` runs one prefill forward of a model loaded by `models.loader.load_model`
over one sequence, through the reference attention (`TorchRefBackend`) and a KV pool of its
own, and returns the float32 log-softmax of the logits at every position. It holds no state
between calls: the pool and the request table are built for the call and dropped.
"""
from __future__ import annotations

import torch

from specserve.attention.torch_ref import TorchRefBackend
from specserve.cache.kv_pool import KVPool
from specserve.cache.req_table import ReqToTokenTable
from specserve.core.forward_batch import ForwardBatch, ForwardMode
from specserve.models.llama import LlamaForCausalLM


@torch.inference_mode()
def position_logprobs(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """log_softmax of the logits after each token of `ids` ([T, V] float32, on the model's device)."""
    cfg, dev = model.config, next(model.parameters()).device
    t = len(ids)
    pool = KVPool(t + 1, cfg.num_layers, cfg.kv_heads_per_rank, cfg.head_dim, next(model.parameters()).dtype, dev)
    table = ReqToTokenTable(1, t, dev)
    slots = torch.arange(1, t + 1)  # slot 0 is the pool's padding slot
    table.write(0, 0, slots)
    rows = torch.arange(t, device=dev)
    backend = TorchRefBackend()
    fb = ForwardBatch(ForwardMode.EXTEND, torch.tensor(ids, device=dev), rows, slots.to(dev),
                      torch.zeros(1, dtype=torch.int64, device=dev), [0], [t], table.table, pool, backend,
                      logit_rows=rows)
    backend.init_forward_metadata(fb)
    hidden, _ = model(fb)
    return model.compute_logits(hidden).float().log_softmax(-1)


def mean_kl(p_logp: torch.Tensor, q_logp: torch.Tensor) -> float:
    """Mean over positions of KL(p || q) in nats, from log-probabilities [T, V]."""
    return float((p_logp.exp() * (p_logp - q_logp)).sum(-1).mean())
