"""`--enable-torch-compile`: the target's forward compiled by torch.compile (inductor).

As SGLang does (its `patch_model`), a compiled forward runs the model's torch-native ops
rather than our fused Triton kernels (`kernels.use_fused` is False while dynamo traces),
so inductor sees the norms, residual adds, RoPE and SiLU*mul and fuses them itself (a
model whose layers run in one C call on the CPU, models/cpu_stack.py, keeps that call
as the custom op `specserve::cpu_stack`). Only attention stays opaque otherwise: it is
the custom op `specserve::attention`, which calls the forward batch's backend (it writes
the new K/V into the pool, so the op has a side effect torch does not see; nothing else
in the graph reads the pool, and each layer's op depends on the previous layer's output,
so the order holds). The batch is handed to the ops through `_current` (`running_batch`)
rather than as an argument: a custom op takes tensors and scalars only.

Only DECODE and VERIFY batches of at most `--torch-compile-max-bs` requests take the
compiled forward (SGLang: the CUDA-graph batch sizes up to that bound); prefill and
larger batches run eagerly. On CUDA the compiled forward is what the graphs capture (their
warm-up runs compile it, outside the capture). Shapes are dynamic after the first
recompile (torch's default), so each mode compiles about twice, not once per batch size.
`SPECSERVE_TORCH_COMPILE_MODE` picks inductor's mode (default: "default").
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from specserve.core import env
from specserve.core.forward_batch import ForwardBatch, ForwardMode

COMPILED_MODES = (ForwardMode.DECODE, ForwardMode.VERIFY)
# Recompiles allowed per code object: modes x (static, dynamic) x grad-free variants, with room.
CACHE_SIZE_LIMIT = 64

_current: ForwardBatch | None = None  # the batch whose compiled forward is running


def running_batch() -> ForwardBatch:
    """The batch whose compiled forward is running (for the custom ops inside it)."""
    assert _current is not None, "a specserve custom op runs only inside a compiled forward"
    return _current


@torch.library.custom_op("specserve::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int,
              scale: float) -> torch.Tensor:
    """The running batch's backend attention (q [T, H, D], k/v [T, kvH, D]) -> [T, H*D]."""
    fb = running_batch()
    return fb.attn_backend.forward(q, k, v, layer_id, fb, scale)


@attention.register_fake
def _attention_shape(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int,
                     scale: float) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


class CompiledForward:
    """`forward(fb) -> (hidden, aux)` compiled, for the batches `serves` accepts."""

    def __init__(self, forward: Callable[[ForwardBatch], tuple[torch.Tensor, list[torch.Tensor]]],
                 max_bs: int) -> None:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, CACHE_SIZE_LIMIT)
        mode = env.torch_compile_mode()
        self.max_bs = max_bs
        self._compiled = torch.compile(forward, mode=mode)

    def serves(self, fb: ForwardBatch) -> bool:
        return fb.mode in COMPILED_MODES and fb.batch_size <= self.max_bs

    def __call__(self, fb: ForwardBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        global _current
        saved, _current = _current, fb
        try:
            return self._compiled(fb)
        finally:
            _current = saved
