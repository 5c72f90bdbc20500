"""Building blocks shared by our model files: RMSNorm, Linear and Embedding.

`Linear` keeps checkpoint layout ([out, in]) for loading. On CPU, `use_gemv_layout()`
swaps it for a contiguous [in, out] copy: batch-1 decode is a GEMV that streams every
weight once, and MKL streams `x @ W` markedly faster than `x @ W.T` at that shape (the
tokens are the same either way). GPUs keep `F.linear`. Quantized (`--quantization fp8`,
or an AWQ/GPTQ checkpoint's int4) it holds the stored weight, float32 scales and, for int4,
zero points (`quantize_storage`, core/quant.py): the few-token kernels read them as they
are, longer inputs go through `quant_linear.py`. Once loaded, int4 layers are held as q4
blocks of the same values where the blocks' kernels serve them (`gpu_layout`,
`cpu_layout`); otherwise the CPU holds the dequantized values (`dequantize_storage`).

`invariant` (set by `models/invariant.py` under --enable-deterministic-inference) puts a
`Linear` on `invariant_linear` and a CPU `RMSNorm` in float64: every row computed one way.

`RMSNorm` runs the fused Triton kernels (`specserve.kernels`) where `use_fused` says so
(CUDA), else the torch path below, which is the reference the kernels are tested against.
`forward_add` folds the residual add that precedes a pre-norm into the norm's launch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve import kernels
from specserve.core import parallel, quant
from specserve.kernels import cpu_quant
from specserve.models.quant_linear import quant_linear


class RMSNorm(nn.Module):
    invariant = False  # --enable-deterministic-inference (models/invariant.py)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.use_fused(x):
            return kernels.rms_norm(x, self.weight, self.eps)
        return self._torch_forward(x)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add fused into the norm on CUDA."""
        if kernels.use_fused(x):
            return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
        residual = residual + x
        return self._torch_forward(residual), residual

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant:  # float64, rounded once: the same bits whatever the row count
            return self.weight * F.rms_norm(x.double(), (x.shape[-1],), None, self.eps).to(x.dtype)
        if x.dtype == torch.float32:  # one fused op; bit-identical to the unfused form
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Half types: normalise in fp32, cast back, then scale, as Hugging Face does.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


class Linear(nn.Module):
    invariant = False  # --enable-deterministic-inference: `invariant_linear` (models/invariant.py)

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.weight_t: torch.Tensor | None = None  # [in, out] when in GEMV layout
        self.weight_scale: torch.Tensor | None = None  # quantized: float32 [out, groups] (core/quant.py)
        self.weight_zeros: torch.Tensor | None = None  # int4: uint8 zero points [out, groups]
        self.group = in_features  # quantized: input columns one scale covers
        self.method = "fp8"  # quantized: core/quant.py's method of `weight`
        self.weight64: torch.Tensor | None = None  # invariant on a CPU: float64 [in, out]

    def quantize_storage(self, group: int | None = None, method: str = "fp8") -> None:
        """Hold the weight quantized (`method` "fp8" or "int4", core/quant.py) with float32
        scales, one per row and per `group` input columns (None: per row), still unloaded:
        the checkpoint fills them (`checkpoint.load_tensor`; float tensors quantized to fp8
        as they land)."""
        n, k = self.weight.shape
        self.group, self.method = group or k, method
        device, groups = self.weight.device, -(-k // (group or k))
        if method == quant.INT4:
            data = torch.zeros(n, -(-k // 2), dtype=torch.uint8, device=device)
            self.weight_zeros = nn.Parameter(torch.zeros(n, groups, dtype=torch.uint8, device=device),
                                             requires_grad=False)
        else:
            data = torch.zeros(n, k, dtype=quant.FP8, device=device)
        self.weight = nn.Parameter(data, requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(n, groups, device=device), requires_grad=False)

    @property
    def quantized(self) -> quant.QuantWeight | None:
        """The quantized weight and its scales (and zeros), or None for a float weight."""
        if self.weight_scale is None:
            return None
        return quant.QuantWeight(self.weight, self.weight_scale, self.group, self.method, self.weight_zeros)

    def hold(self, qw: quant.QuantWeight) -> None:
        """Take `qw` as the layer's weight (a loaded weight in another form: GGUF's blocks)."""
        self.weight = nn.Parameter(qw.data, requires_grad=False)
        self.weight_t = None
        self.weight_scale = nn.Parameter(qw.scale, requires_grad=False)
        self.weight_zeros = None if qw.zeros is None else nn.Parameter(qw.zeros, requires_grad=False)
        self.group, self.method = qw.group, qw.method

    def dequantize_storage(self, dtype: torch.dtype) -> None:
        """Replace the quantized weight by its values in `dtype` (the CPU's form: it has no
        fp8 or int4 kernels)."""
        qw = self.quantized
        if qw is not None:
            self.weight = nn.Parameter(qw.dequantize(dtype), requires_grad=False)
            self.weight_scale = self.weight_zeros = None

    def use_gemv_layout(self) -> None:
        """Replace weight [out, in] by a contiguous weight_t [in, out] (after loading)."""
        self.weight_t = nn.Parameter(self.weight.detach().t().contiguous(), requires_grad=False)
        del self.weight
        # weight is declared a Parameter for every caller that runs before this swap; from
        # here on it is None and readers go through weight_t / out_in_weight
        self.weight = None  # type: ignore[assignment]  # tombstone of the [out, in] layout

    @property
    def out_in_weight(self) -> torch.Tensor | quant.QuantWeight:
        """The weight as [out, in] for the kernels: a transposed view in GEMV layout, the
        fp8 weight with its scales when quantized."""
        qw = self.quantized
        if qw is not None:
            return qw
        return self.weight if self.weight_t is None else self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant:
            return invariant_linear(x, self.out_in_weight, self.weight64, self.bias)
        qw = self.quantized
        if qw is not None:
            return quant_linear(x, qw, self.bias)
        if self.weight_t is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor | quant.QuantWeight, weight64: torch.Tensor | None,
                     bias: torch.Tensor | None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] times weight [N, K] (+ bias) -> [..., N] in `out_dtype` (default x's), each
    row computed one way whatever the row count: the Triton kernel where the fused kernels
    run (kernels/invariant_mm.py, fp8 weights too; a GPU's quantized blocks:
    `kernels.invariant_blocks`, the bias added after), else float64 against `weight64`
    ([K, N]; from `weight` when None), rounded once (models/invariant.py)."""
    flat = x.reshape(-1, x.shape[-1])
    if isinstance(weight, quant.QuantWeight) and weight.method == "fp8":
        y = kernels.invariant_matmul(flat, weight.data, bias, out_dtype, scale=weight)
    elif isinstance(weight, quant.QuantWeight):
        y = kernels.invariant_blocks(flat, weight, out_dtype)
        if bias is not None:
            y = (y + bias).to(y.dtype)
    elif kernels.use_fused(flat):
        y = kernels.invariant_matmul(flat, weight, bias, out_dtype)
    else:
        w64 = weight64 if weight64 is not None else weight.detach().t().double()
        y64 = flat.double() @ w64
        if bias is not None:
            y64 += bias.double()
        y = y64.to(out_dtype or x.dtype)
    return y.view(*x.shape[:-1], -1)


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a model computes in: its first parameter's that is not a quantized
    layer's storage (fp8, packed int4) nor a scale."""
    for name, p in model.named_parameters():
        if p.dtype.is_floating_point and p.element_size() >= 2 and not name.endswith(("_scale", "_zeros")):
            return p.dtype
    raise ValueError(f"{type(model).__name__} has no floating-point parameter")


def cpu_layout(model: nn.Module, dtype: torch.dtype) -> None:
    """Every `Linear` of a loaded model in the CPU's form: an int4 one (AWQ, GPTQ) as q4
    blocks of the same values, one scale a block, where the CPU's quantized kernels take it
    (kernels/cpu_quant.py: whole tiles, a compiler at hand; under tensor parallelism each
    rank's slice, cut on group edges); any other quantized one as its values in `dtype`
    (the CPU has no fp8 kernels); then the float ones in the GEMV layout. A GGUF's blocks
    (q4, q8) are not yet held here: models/gguf_serve.py swaps them in after."""
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        qw = module.quantized
        if qw is not None and _int4_as_blocks(qw):
            blocks = quant.int4_to_q4(qw, shared=1)
            assert blocks.zeros is not None
            if cpu_quant.servable(blocks) and cpu_quant.available():  # float32 scales: what the CPU takes
                module.hold(blocks._replace(scale=blocks.scale.float(), zeros=blocks.zeros.float()))
                continue
        module.dequantize_storage(dtype)
        module.use_gemv_layout()


def _int4_as_blocks(qw: quant.QuantWeight) -> bool:
    """Whether an int4 weight's groups and rows are whole q4 blocks (`int4_to_q4`)."""
    return qw.method == quant.INT4 and qw.group % 32 == 0 and qw.shape[1] % 32 == 0


def gpu_layout(model: nn.Module) -> None:
    """Every int4 `Linear` (AWQ, GPTQ) of a loaded model on a GPU as q4 blocks of the same
    values (core/quant.py `int4_to_q4`), where its groups and rows are whole blocks: the
    few-token kernel of GGUF's blocks (kernels/blocks.py) streams them faster than
    kernels/int4.py streams the int4 layout."""
    for module in model.modules():
        qw = module.quantized if isinstance(module, Linear) else None
        if isinstance(module, Linear) and qw is not None and _int4_as_blocks(qw):
            module.hold(quant.int4_to_q4(qw))


class Embedding(nn.Embedding):
    """nn.Embedding whose lookup of a flat id vector is one Triton gather where the fused
    kernels run (`kernels.embedding`), outside autograd (the kernel has no backward).

    Vocab-parallel under tensor parallelism (core/parallel.py): each rank holds the rows
    [vocab_start, vocab_start + num_embeddings) of the table; an id outside them looks up
    zeros, and the ranks' lookups are summed."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        local = parallel.vocab_per_rank(num_embeddings)
        super().__init__(local, embedding_dim)
        self.vocab_start = parallel.tp_rank() * local

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if parallel.tp_size() > 1:
            local = ids - self.vocab_start
            inside = (local >= 0) & (local < self.num_embeddings)
            rows = self._lookup(torch.where(inside, local, torch.zeros_like(local)))
            return parallel.all_reduce(rows * inside.unsqueeze(-1).to(rows.dtype))
        return self._lookup(ids)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() == 1 and kernels.use_fused(self.weight) and not torch.is_grad_enabled():
            return kernels.embedding(ids, self.weight)
        return super().forward(ids)
