"""EAGLE-3 draft head (`LlamaForCausalLMEagle3`, the cnets layout): one `midlayer`.

    h = fc(hidden) if hidden is not H wide else hidden      fc: [H, 3 * target_hidden]
    e, hn = input_layernorm(embed(ids)), hidden_norm(h)
    x = r + attn(cat(e, hn))       r = h, or hn with vLLM's `norm_before_residual`
    out = x + mlp(post_attention_layernorm(x))
    h_logits = norm(out) -> the draft's own lm_head [draft_vocab, H];  h_next = out

The first draft step reads the target's aux features (3 residual-stream states, 3H);
later steps feed the draft's own pre-norm `out` (H). The draft vocabulary maps to target
ids through `d2t` offsets: token_map = arange(draft_vocab) + d2t (`t2d` is ignored).
Without `draft_vocab_size` the head is the target's (full vocab). Checkpoint names are
our parameter names; loading and sharing are `draft_loader.py`'s. Held in GGUF blocks on
the CPU, the midlayer runs in one C call (`cpu_stack`, models/cpu_stack.py).
"""
from __future__ import annotations

import torch
from torch import nn

from specserve import kernels
from specserve.core import parallel
from specserve.core.forward_batch import ForwardBatch
from specserve.core.rope import RopeAt
from specserve.models.cpu_stack import CpuStack
from specserve.models.draft_model import DraftModel
from specserve.models.layers import Linear, RMSNorm
from specserve.models.llama import MLP, Attention, LlamaConfig


class Eagle3MidLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, norm_before_residual: bool) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)  # on the token embedding
        self.hidden_norm = RMSNorm(h, eps)  # on the incoming hidden
        self.self_attn = Attention(cfg, 0, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(cfg)
        self.norm_before_residual = norm_before_residual

    def forward(self, ids: torch.Tensor, embed: nn.Embedding, h: torch.Tensor, fb: ForwardBatch,
                rope: RopeAt) -> torch.Tensor:
        """The layer over tokens `ids` [T] (embedded by `embed`, the target's) and hidden h [T, H]."""
        table = embed.weight
        if (kernels.use_fused(h) and table.dtype == h.dtype and not torch.is_grad_enabled()
                and parallel.tp_size() == 1):  # a vocab-parallel table is looked up by `embed`
            # the embedding gather, both norms (one eps) and the cat: one launch
            x = kernels.rms_norm_pair(table, self.input_layernorm.weight, h, self.hidden_norm.weight,
                                      self.hidden_norm.eps, ids=ids)
            hn = x[:, h.shape[-1]:]
        else:
            hn = self.hidden_norm(h)
            x = torch.cat([self.input_layernorm(embed(ids)), hn], dim=-1)
        residual = hn if self.norm_before_residual else h
        if kernels.use_gemv(x) and fb.attn_backend.pooled_kv and self.self_attn.few_tokens_ready:
            # a few rows (a drafting depth): the residual adds ride on o_proj's and
            # down_proj's GEMVs, the post-attention norm and SiLU*mul on gate_up's
            x = self.self_attn.forward_few_tokens(x, None, fb, rope, residual=residual)
            return self.mlp.forward_few_tokens(x, self.post_attention_layernorm)
        x = residual + self.self_attn(x, fb, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLMEagle3(DraftModel):
    feature_mode = "aux"
    d2t: torch.Tensor  # [draft_vocab] int64 buffer, registered when the head owns its vocabulary

    def __init__(self, cfg: LlamaConfig, target_hidden_size: int, draft_vocab_size: int | None,
                 aux_layers: tuple[int, ...], fc_bias: bool = False, norm_before_residual: bool = False) -> None:
        super().__init__(cfg)
        h = cfg.hidden_size
        self.aux_layers = aux_layers
        self.fc = Linear(len(aux_layers) * target_hidden_size, h, bias=fc_bias)
        self.midlayer = Eagle3MidLayer(cfg, norm_before_residual)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.cpu_stack: CpuStack | None = None  # the midlayer in one C call (`build_cpu_stack`)
        if draft_vocab_size is not None:
            self.owns_lm_head = True
            self.lm_head = nn.Linear(h, parallel.vocab_per_rank(draft_vocab_size), bias=False)  # vocab-parallel
            # Offsets: draft index i is target token i + d2t[i]. A buffer, so that loading
            # and `.to(device)` treat it like a weight (integer buffers keep their dtype).
            self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))

    def forward(self, fb: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if hidden.shape[-1] != self.config.hidden_size:  # target aux features [T, 3 * H_target] -> [T, H]
            # a few rows (a draft extend) take the GEMV, faster than cuBLAS at so few rows;
            # not while training (the Triton kernels have no backward)
            if self.fc.bias is None and kernels.use_gemv(hidden) and not torch.is_grad_enabled():
                hidden = kernels.gemv(hidden, self.fc.out_in_weight)
            else:
                hidden = self.fc(hidden)
        stack = self.cpu_stack
        if (stack is not None and stack.serves(fb, hidden) and not torch.is_grad_enabled()
                and not torch.compiler.is_compiling()):
            assert self.embed_tokens is not None, "`share` attached the target's embedding"
            out = hidden.contiguous().clone()  # updated in place; `hidden` may be the roots' state
            normed, _ = stack.run(out, fb, (), embed=self.embed_tokens(fb.input_ids).float().contiguous())
            return normed, out
        out = self.midlayer(fb.input_ids, self.embed_tokens, hidden, fb, self.rotary.at(fb.positions))
        return self.norm(out), out

    def build_cpu_stack(self) -> None:
        self.cpu_stack = CpuStack.build_eagle3(self)

    def finalize(self, device: torch.device, dtype: torch.dtype) -> None:
        super().finalize(device, dtype)
        if self.owns_lm_head:
            self.token_map = torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def param_name(self, ckpt_name: str) -> str | None:
        if ckpt_name in ("t2d", "embed_tokens.weight"):  # t2d: unused; embedding: the target's
            return None
        if not self.owns_lm_head and ckpt_name in ("lm_head.weight", "d2t"):
            return None  # no draft_vocab_size: the target's head is used (the loader logs it)
        return ckpt_name
