"""`--enable-deterministic-inference` on a model: every row computed one way, whatever the batch.

Invariant: the logits of a token, and every K/V it leaves in the cache, are the same bits
whether it is decoded alone, verified as a node of a draft tree, computed in a prefill
chunk, or batched with any other requests. Greedy speculative decoding then equals plain
decoding bit for bit in bf16 (exact arithmetic alone made it equal in fp32), and a
request's output never depends on its neighbours.

What `LlamaForCausalLM.make_invariant` changes on a target (drafts are left as they are:
they only propose, and exact verification makes the output the target's):
  * every linear layer and the LM head run one kernel whose row arithmetic is fixed by the
    weight alone (`kernels/invariant_mm.py`), never cuBLAS (its kernel follows M) nor the
    few-token GEMVs (their tiles follow the token count): `Linear.invariant`, and
    `LlamaForCausalLM` leaves its few-token path; the logits come out in fp32 from the
    kernel's accumulator on every path (no rounding to the model's dtype first);
  * norms, RoPE, SiLU*mul and the residual adds are row-local already (one program per
    row, or elementwise);
  * attention walks each query's keys in position order with splits fixed by its own
    length (`attention/triton_invariant.py`, chosen by the runner's `make_backend`).
On a CPU (no Triton), the same contract in torch (`layers.invariant_linear`, `RMSNorm`,
the MLP's SiLU, the reference attention): products, sums, norms and SiLU in float64,
rounded once to the model's dtype. CPU libraries pick their summation order from the
shape, but in float64 every order lands within ~1e-13 (relative) of the exact value, so
rounding to bf16 (a step of 2^-8) comes out the same unless the exact value sits that
close to a rounding boundary. Exact by construction on the GPU; on the CPU, by that margin.
"""
from __future__ import annotations

from torch import nn

from specserve.models.layers import Linear, RMSNorm


def enable_layers(model: nn.Module) -> None:
    """Put every `Linear` and `RMSNorm` of `model` on the invariant path (a causal LM's
    head and few-token path: `LlamaForCausalLM.make_invariant`). Quantized layers are
    refused (their kernels are not covered)."""
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            if module.quantized is not None:
                raise ValueError(f"--enable-deterministic-inference does not cover quantized layers ({name})")
            module.invariant = True
            if module.weight_t is not None:  # the CPU's layout: keep the float64 copy it multiplies by
                module.weight64 = module.weight_t.detach().double()
        elif isinstance(module, RMSNorm):
            module.invariant = True
