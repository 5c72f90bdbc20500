"""A GGUF model served in its own blocks (`--quantization gguf`), on the CPU or a GPU.

`resolve` decides: a converted GGUF directory that carries its blocks
(models/gguf_blocks.py) is served quantized on the CPU unless `--quantization none` asks for
float weights, and on a GPU when `--quantization gguf` asks for it (its float weights stay
the default there); never where the caller cannot take quantized layers
(`--enable-deterministic-inference` on a GPU; on the CPU the blocks' kernels keep its
contract: models/invariant.py). Under tensor parallelism each rank keeps its slice of the
blocks, cut as the float weights are (`_rank_slice`, models/tp_shard.py). `--quantization
gguf` on anything else is an error. The CPU multiplies the blocks with kernels/cpu_quant.py,
a GPU with the Triton kernel kernels/blocks.py (models/quant_linear.py picks). Loading
(models/loader.py) runs in three steps. `plan`, on the meta model: each `Linear` whose rows
are all repacked blocks (q, k and v of one method and group for the fused qkv; gate and up
for gate_up) will hold them. `reserve`: such a layer's float weight has no rows, so the
checkpoint's float values of it are never read nor allocated. `apply`, once the rest has
loaded: each planned layer takes its blocks as its storage, and the LM head's blocks become
the model's `head_blocks`, read by `compute_logits` (the float head stays for drafts that
share it). Layers whose GGUF type is not repacked stay float. On the CPU the blocks are the
checkpoint file's mapped pages, as are the float embedding table and a head tied to it, and
when every layer holds blocks the model's few-token forwards run in one C call
(models/cpu_stack.py). On a GPU the blocks are copied to the device, their scales and
offsets in float16 where that is exact.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, cast

import torch
from safetensors import safe_open
from torch import nn

from specserve import kernels
from specserve.core import parallel, quant
from specserve.core.config import ConfigError
from specserve.kernels import cpu_quant
from specserve.models import gguf_blocks, tp_shard
from specserve.models.checkpoint import fused_target
from specserve.models.cpu_stack import CpuStack
from specserve.models.layers import Linear

if TYPE_CHECKING:
    from specserve.models.draft_model import DraftModel
    from specserve.models.llama import LlamaConfig, LlamaForCausalLM

logger = logging.getLogger("specserve")

GGUF, NONE = "gguf", "none"  # --quantization values this file owns
CPU_LAYOUT_FILE = "blocks-cpu.safetensors"  # beside the blocks: kernels/cpu_quant.py `map_packed`


def resolve(flag: str | None, model_dir: Path, device: torch.device, allowed: bool = True) -> bool:
    """Whether `model_dir` is served in its GGUF blocks. `allowed` False: the caller takes
    float layers only (an explicit `--quantization gguf` is then an error)."""
    has_blocks = (Path(model_dir) / gguf_blocks.BLOCKS_FILE).is_file()
    if flag == GGUF:
        if not has_blocks:
            raise ConfigError(f"--quantization gguf needs a GGUF model; {model_dir} was not converted from one")
        if not allowed:
            raise ConfigError("--quantization gguf with --enable-deterministic-inference on a GPU needs bf16 or "
                              "fp16 activations (--dtype); float32 is not supported yet")
    if not (flag in (None, GGUF) and has_blocks and allowed):
        return False
    if device.type == "cuda":  # asked for only: the float weights stay the GPU's default
        if flag == GGUF and not kernels.triton_available():
            raise ConfigError("--quantization gguf on a GPU needs triton (its kernels are Triton's)")
        return flag == GGUF
    if not cpu_quant.available():  # said in the log by cpu_quant
        if flag == GGUF:
            raise ConfigError("--quantization gguf: the quantized CPU kernels could not be built (see the log)")
        return False
    return True


class Blocks(NamedTuple):
    """What a GGUF's blocks file gives a model (`plan`): each `Linear`'s blocks by module
    name, as the file maps them, and the LM head's (None: it stays float)."""
    layers: dict[str, quant.QuantWeight]
    head: quant.QuantWeight | None


def plan(model: LlamaForCausalLM, model_dir: Path) -> Blocks:
    """The blocks of `model_dir` that `model` (on the meta device: only shapes are read)
    will hold: a `Linear` whose rows are all repacked blocks of one form and its shape."""
    path = Path(model_dir) / gguf_blocks.BLOCKS_FILE
    methods = gguf_blocks.methods(path)
    cfg = model.config
    pieces: dict[str, list[tuple[int, str]]] = {}  # our weight name -> [(first row, HF name)]
    for name in methods:
        target, offset = fused_target(name, cfg)
        pieces.setdefault(target, []).append((offset, name))
    layers: dict[str, quant.QuantWeight] = {}
    head = None
    with safe_open(str(path), framework="pt") as f:
        for module_name, module in model.named_modules():
            parts = sorted(pieces.get(f"{module_name}.weight", []))
            if isinstance(module, Linear) and parts:
                qw = _joined(f, [name for _, name in parts], methods)
                qw = None if qw is None else _rank_slice(f"{module_name}.weight", qw, cfg)
                if qw is not None and qw.shape == tuple(module.weight.shape):
                    layers[module_name] = qw
        name = "lm_head.weight" if "lm_head.weight" in methods else "model.embed_tokens.weight"
        if name in methods and (name == "lm_head.weight" or cfg.tie_word_embeddings):
            head = _joined(f, [name], methods)
            head = None if head is None else _rank_slice(name, head, cfg)
    return Blocks(layers, head)


def _rank_slice(name: str, qw: quant.QuantWeight, cfg: LlamaConfig) -> quant.QuantWeight:
    """This tensor-parallel rank's slice of the blocks of our weight `name` (models/tp_shard.py):
    a fused qkv or gate_up is cut as its HF parts are, each part's rows apart."""
    if parallel.tp_size() == 1:
        return qw
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if ".qkv_proj." in name:
        parts = [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)]
        old = "qkv_proj"
    elif ".gate_up_proj." in name:
        inter = qw.shape[0] // 2
        parts, old = [("gate_proj", 0, inter), ("up_proj", inter, inter)], "gate_up_proj"
    else:
        return tp_shard.shard_quant(name, qw, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    pieces = [tp_shard.shard_quant(name.replace(old, hf), _rows(qw, start, rows), cfg.num_heads,
                                   cfg.num_kv_heads, cfg.head_dim) for hf, start, rows in parts]
    zeros = None if qw.zeros is None else torch.cat([cast(torch.Tensor, p.zeros) for p in pieces])
    return pieces[0]._replace(data=torch.cat([p.data for p in pieces]), scale=torch.cat([p.scale for p in pieces]),
                              zeros=zeros)


def _rows(qw: quant.QuantWeight, start: int, rows: int) -> quant.QuantWeight:
    """Rows [start, start + rows) of `qw`."""
    return qw._replace(data=qw.data.narrow(0, start, rows), scale=qw.scale.narrow(0, start, rows),
                       zeros=None if qw.zeros is None else qw.zeros.narrow(0, start, rows))


def reserve(model: LlamaForCausalLM, blocks: Blocks) -> set[str]:
    """Before `model` (on the meta device) is materialised: each `Linear` that will hold
    blocks gets a float weight of no rows, so its float values are never allocated nor
    read (a 4-bit file's float model is about 7x its size, on the device or in memory).
    Returns the weight names the checkpoint need not fill."""
    for name in blocks.layers:
        module = cast(Linear, model.get_submodule(name))
        module.weight = nn.Parameter(torch.empty(0, module.weight.shape[1], device="meta"), requires_grad=False)
    return {f"{name}.weight" for name in blocks.layers}


def apply(model: LlamaForCausalLM, blocks: Blocks, model_dir: Path, device: torch.device,
          private: bool = False) -> int:
    """Swap `blocks` into `model` (loaded and finalised on `device`, the layers `reserve`d);
    returns how many layers now hold blocks. `private`: this process serves the model alone
    (its CPU layouts may leave the shared file for huge pages: `_map_cpu_layouts`)."""
    for name, qw in blocks.layers.items():
        cast(Linear, model.get_submodule(name)).hold(_on_device(qw, device))
    if blocks.head is not None:
        model.head_blocks = _on_device(blocks.head, device)
    if device.type == "cpu":
        _map_embedding(model, Path(model_dir))
        _map_cpu_layouts(model, Path(model_dir) / gguf_blocks.BLOCKS_FILE, private)
        model.cpu_stack = CpuStack.build(model)
    return len(blocks.layers)


def _map_cpu_layouts(model: LlamaForCausalLM, blocks_path: Path, private: bool) -> None:
    """The CPU kernels' layout of every weight held in blocks, as a file beside the blocks
    (written by the first process to serve them) that every process maps; copied into huge
    pages when `private` (one process: the 4 KiB pages of a mapped file cost a decode step
    a page walk every 4 KiB of weights)."""
    held = {name: m.quantized for name, m in model.named_modules() if isinstance(m, Linear) and m.quantized is not None}
    if model.head_blocks is not None:
        held["lm_head"] = model.head_blocks
    stat = blocks_path.stat()
    cpu_quant.map_packed(blocks_path.parent / cpu_layout_file(), held, f"{stat.st_size}-{stat.st_mtime_ns}", private)


def cpu_layout_file() -> str:
    """The CPU layout's file name: one a tensor-parallel rank, whose slices differ."""
    tp = parallel.tp_size()
    return CPU_LAYOUT_FILE if tp == 1 else CPU_LAYOUT_FILE.replace(".", f"-tp{tp}-rank{parallel.tp_rank()}.", 1)


def quantize_random(model: LlamaForCausalLM) -> int:
    """Random float weights (`--load-format dummy --quantization gguf`, benchmarks) in the
    blocks a Q4_1 GGUF file holds: every projection q4, the LM head q8 (core/quant.py's
    `quantize_blocks`; float32 scales on the CPU, whose kernels take those). Returns how
    many layers hold blocks."""
    served = 0
    for module in model.modules():
        if isinstance(module, Linear) and module is not model.lm_head and module.quantized is None:
            weight = module.out_in_weight
            assert isinstance(weight, torch.Tensor)
            module.hold(_blocks_of(weight, quant.Q4))
            served += 1
    model.head_blocks = _blocks_of(model.lm_head.weight, quant.Q8)
    if model.lm_head.weight.device.type == "cpu":
        model.cpu_stack = CpuStack.build(model)
    return served


def quantize_draft(draft: DraftModel, target: LlamaForCausalLM) -> int:
    """An EAGLE-family draft of a target served in GGUF blocks on the CPU, in Q8_0's blocks
    (the default of `--speculative-draft-model-quantization`, which follows the target's):
    each projection the CPU kernels take, and its head (`head_blocks`: the target's own
    blocks where it shares the target's head). The draft only proposes tokens; the
    target's verify keeps the output exact. Returns how many layers hold blocks."""
    served = 0
    for module in draft.modules():
        weight = module.out_in_weight if isinstance(module, Linear) and module.quantized is None else None
        if isinstance(weight, torch.Tensor) and weight.shape[1] % 32 == 0:
            qw = _blocks_of(weight, quant.Q8)
            if cpu_quant.servable(qw):
                cast(Linear, module).hold(qw)
                served += 1
    head = draft.lm_head
    if head is not None:
        shared = head is target.lm_head and target.head_blocks is not None
        draft.head_blocks = target.head_blocks if shared else _blocks_of(head.weight, quant.Q8)
    draft.build_cpu_stack()
    return served


def _blocks_of(weight: torch.Tensor, method: str) -> quant.QuantWeight:
    """A float weight in GGUF's simplest blocks (core/quant.py `quantize_blocks`), with
    float32 scales on the CPU, whose kernels take those."""
    qw = quant.quantize_blocks(weight, method)
    if weight.device.type == "cpu":
        qw = qw._replace(scale=qw.scale.float(), zeros=None if qw.zeros is None else qw.zeros.float())
    return qw


def _on_device(qw: quant.QuantWeight, device: torch.device) -> quant.QuantWeight:
    """`qw` where the model is: as mapped on the CPU; on a GPU, copied there with its scales
    and offsets narrowed to float16 where every one of them is exact in it (GGUF stores
    Q4_0/Q4_1/Q8_0's in float16; Q4_K's and Q6_K's products of two scales are not), which
    cuts the bytes a weight by a sixth to a quarter and changes no value."""
    if device.type == "cpu":
        return qw
    return quant.QuantWeight(qw.data.to(device), quant.narrow_exact(qw.scale).to(device), qw.group, qw.method,
                             None if qw.zeros is None else quant.narrow_exact(qw.zeros).to(device))


EMBEDDING = "model.embed_tokens.weight"


def _map_embedding(model: LlamaForCausalLM, model_dir: Path) -> None:
    """The float embedding table (and the head tied to it) as the converted checkpoint's
    pages, as safetensors maps them, where its dtype and shape are the model's: shared by
    every process serving the model, like the blocks, instead of a copy in each."""
    table = model.model.embed_tokens.weight
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            if EMBEDDING not in f.keys():
                continue
            mapped = f.get_tensor(EMBEDDING)
        if mapped.dtype != table.dtype or mapped.shape != table.shape:
            return
        param = nn.Parameter(mapped, requires_grad=False)
        model.model.embed_tokens.weight = param
        if model.lm_head.weight is table:
            model.lm_head.weight = param
        return


def _joined(f, names: list[str], methods: dict[str, tuple[str, int]]) -> quant.QuantWeight | None:
    """One QuantWeight of the weights `names` stacked by rows; None if they differ in form.
    One name (a fused projection as the conversion stores it, or a lone one): its tensors
    as safetensors maps them from the file, not copied, so the pages are shared by every
    process that serves the model and by the OS's page cache."""
    forms = {methods[n] for n in names}
    if len(forms) != 1:
        return None
    (method, group), = forms
    keys = f.keys()
    offsets = [f"{n}.offset" in keys for n in names]
    if any(offsets) and not all(offsets):
        return None

    def cat(part: str) -> torch.Tensor:
        if len(names) == 1:
            return f.get_tensor(f"{names[0]}.{part}")
        return torch.cat([f.get_tensor(f"{n}.{part}") for n in names]).contiguous()

    return quant.QuantWeight(cat("q"), cat("scale"), group, method, cat("offset") if offsets[0] else None)
