"""Test helpers: tiny random Hugging Face checkpoints and a bare forward without a scheduler."""
from __future__ import annotations

from pathlib import Path

import torch

from specserve.attention.torch_ref import TorchRefBackend
from specserve.cache.kv_pool import KVPool
from specserve.cache.req_table import ReqToTokenTable
from specserve.core.forward_batch import ForwardBatch, ForwardMode
from specserve.models.llama import LlamaForCausalLM

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)


def save_tiny_hf(kind: str, path: Path, vocab_size: int = 512, seed: int = 0, **overrides) -> Path:
    """Save a randomly initialised tiny HF model of `kind` (llama|qwen2|qwen3) to `path`."""
    import transformers as tf

    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[kind]
    extra = {"head_dim": 16} if kind == "qwen3" else {}
    cfg = cfg_cls(vocab_size=vocab_size, **{**TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # random, non-trivial norms and biases so a wrong load shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return path


class BareRunner:
    """One model, one KV pool, one request row: prefill/decode/verify by hand."""

    def __init__(self, model: LlamaForCausalLM, num_slots: int = 1024, max_reqs: int = 8) -> None:
        cfg = model.config
        dev = next(model.parameters()).device
        self.model = model
        self.pool = KVPool(num_slots, cfg.num_layers, cfg.kv_heads_per_rank, cfg.head_dim,
                           next(model.parameters()).dtype, dev)
        self.table = ReqToTokenTable(max_reqs, 512, dev)
        self.backend = TorchRefBackend()
        self.next_slot = 1
        self.dev = dev

    def slots(self, n: int) -> torch.Tensor:
        s = torch.arange(self.next_slot, self.next_slot + n)
        self.next_slot += n
        return s

    @torch.inference_mode()
    def forward(self, rows: list[int], prefix_lens: list[int], tokens: list[list[int]],
                positions: list[list[int]] | None = None, masks: list[torch.Tensor] | None = None,
                mode: ForwardMode = ForwardMode.EXTEND) -> torch.Tensor:
        """Logits [T, V] for every new token; new tokens' slots are appended to each row."""
        out_slots = []
        for row, p, toks in zip(rows, prefix_lens, tokens):
            s = self.slots(len(toks))
            self.table.write(row, p, s)
            out_slots.append(s)
        if positions is None:
            positions = [[p + i for i in range(len(t))] for p, t in zip(prefix_lens, tokens)]
        flat = [t for ts in tokens for t in ts]
        ids, pos, slots, req_rows, logit_rows = (t.to(self.dev) for t in (
            torch.tensor(flat), torch.tensor([q for ps in positions for q in ps]), torch.cat(out_slots),
            torch.tensor(rows), torch.arange(len(flat))))  # on the model's device (GPU runs too)
        fb = ForwardBatch(mode, ids, pos, slots, req_rows, prefix_lens, [len(t) for t in tokens],
                          self.table.table, self.pool, self.backend, custom_masks=masks, logit_rows=logit_rows)
        self.backend.init_forward_metadata(fb)
        hidden, _ = self.model(fb)
        return self.model.compute_logits(hidden)


# On a GPU an engine sizes its KV pool from the free memory (most of it): a test that
# builds a second engine while the first is still referenced would fail at start-up.
GPU_TEST_KV_SLOTS = 16384
# Engines whose output tests compare token for token with another engine's (speculative vs
# plain, batch 8 vs batch 1) run in float32 on a GPU too: bf16 is not batch-invariant, so a
# verify over 16 tree tokens and a decode of one may round a near-tie apart. Their KV pool
# is bounded there, so that several fit beside the session's shared engine. They capture no
# prefill graphs (30 captures, some 10 s an engine): those have tests of their own
# (test_prefill_graphs.py, test_spec_pipeline.py's captured prefills).
EXACT_ON_GPU = {"dtype": "float32", "max_total_tokens": GPU_TEST_KV_SLOTS,
                "cuda_graph_max_prefill_tokens": 0} if torch.cuda.is_available() else {}


def tiny_engine(target: Path, tokenizer_dir: Path, **flags):
    """An Engine over a tiny saved target with the default model's tokenizer. On CUDA its
    KV pool is bounded (GPU_TEST_KV_SLOTS) so several fit on one GPU at once, and it runs
    in float32 unless told otherwise: these targets and drafts are built to be exact (a
    "perfect" draft scores 900 against 842 through an o_proj scaled by 1e5), which bf16's
    8-bit mantissa does not keep, and CPU runs are float32 too."""
    from specserve import Engine

    flags = EXACT_ON_GPU | flags
    return Engine(str(target), tokenizer_path=str(tokenizer_dir), log_level="warning", **flags)


def held_out_greedy(engine, plain, max_new_tokens: int) -> tuple[list[list[int]], list[dict]]:
    """Two MT-bench questions the shipped head never trained on (14 and 15), greedy: the
    plain engine's outputs (batched) and `engine`'s results (one request at a time)."""
    from specserve.bench.prompts import questions

    tok = engine.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": q[0]}]) for q in questions("mtbench", 16)[-2:]]
    params = {"temperature": 0, "max_new_tokens": max_new_tokens}
    want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    return want, [engine.generate(input_ids=p, sampling_params=params) for p in prompts]
