"""The reference attention backend: gather K/V by slot, run SDPA with an explicit mask.

Slow and obviously right; runs on CPU and GPU and is the oracle every kernel is tested
against. Each forward pads the batch to [B, max_new] queries over [B, max_kv] keys:
  key j of request b is visible to its new token i iff
    j < prefix_b                                   (the cached prefix), or
    j - prefix_b <= i (causal) / custom_mask_b[i, j - prefix_b]   (the new tokens),
  and j < prefix_b + n_b. Padded query rows see key 0 only (their output is dropped).
A DECODE batch with a `draft_tail` reads keys [0, prefix_b) through the row and then the
tail's d slots: kv_index = row[:max_prefix] ++ tail, with row columns >= prefix_b masked.
An fp8 pool's K/V are read back as stored * scale in the queries' dtype (cache/kv_pool.py).
`float64=True` (--enable-deterministic-inference on a CPU, models/invariant.py) runs SDPA
in float64 and rounds once: a query's output then does not depend on the padding, the
masked keys between its visible ones or its batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from specserve.attention.base import AttentionBackend
from specserve.cache.kv_pool import dequantize
from specserve.core.forward_batch import ForwardBatch, ForwardMode


@dataclass
class RefMeta:
    kv_index: torch.Tensor  # [B, max_kv] slots (padding points at real but masked slots)
    q_index: torch.Tensor  # [B, max_new] rows into the packed T tokens (padding -> 0)
    q_valid: torch.Tensor  # [B * max_new] bool: which padded rows are real tokens
    mask: torch.Tensor | None  # [B, 1, max_new, max_kv] bool, None when nothing is masked


class TorchRefBackend(AttentionBackend):
    def __init__(self, float64: bool = False) -> None:
        self.float64 = float64

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        fb.settle_prefix()
        if fb.draft_tail is not None:
            fb.attn_meta = self._tail_meta(fb)
        elif fb.batch_size == 1 and (fb.custom_masks is None or fb.custom_masks[0].shape[0] == fb.extend_lens[0]):
            fb.attn_meta = self._one_meta(fb)
        else:
            fb.attn_meta = self._batch_meta(fb)

    @staticmethod
    def _one_meta(fb: ForwardBatch) -> RefMeta:
        """`_batch_meta` of one request, in a few ops (on a CPU each op after a forward runs
        on cold caches): no padding, so the queries are rows 0..n-1, all real, and the mask
        is None for one token, else the prefix then the causal or custom block."""
        dev, n, p = fb.input_ids.device, fb.extend_lens[0], fb.prefix_lens[0]
        kv_index = fb.req_to_token[fb.req_rows, :p + n].contiguous()
        q_index = torch.arange(n, device=dev)[None]
        mask = None
        if n > 1:
            mask = torch.ones(n, p + n, dtype=torch.bool, device=dev)
            custom = fb.custom_masks[0].to(dev) if fb.custom_masks is not None else None
            mask[:, p:] = custom if custom is not None else torch.ones(n, n, dtype=torch.bool, device=dev).tril()
            mask = mask[None, None]
        return RefMeta(kv_index, q_index, torch.ones(n, dtype=torch.bool, device=dev), mask)

    def _batch_meta(self, fb: ForwardBatch) -> RefMeta:
        dev = fb.input_ids.device
        prefix = torch.tensor(fb.prefix_lens, device=dev)
        new = torch.tensor(fb.extend_lens, device=dev)
        max_new, max_kv = max(fb.extend_lens), max(fb.seq_lens)
        kv_index = fb.req_to_token[fb.req_rows, :max_kv].contiguous()
        starts = torch.cumsum(new, 0) - new
        i = torch.arange(max_new, device=dev)
        q_valid = i[None, :] < new[:, None]  # [B, max_new]
        q_index = torch.where(q_valid, starts[:, None] + i[None, :], 0)
        mask = None
        uniform_decode = max_new == 1 and min(fb.seq_lens) == max_kv
        if not uniform_decode:
            mask = self._build_mask(fb, prefix, new, q_valid, max_new, max_kv)
        return RefMeta(kv_index, q_index, q_valid.reshape(-1), mask)

    def init_tail_metadata(self, fb: ForwardBatch, tail_start: torch.Tensor) -> None:
        """The reference reads the lengths back (a sync): it never runs inside a graph."""
        fb.prefix_lens = tail_start.tolist()
        fb.attn_meta = self._tail_meta(fb)

    @staticmethod
    def _tail_meta(fb: ForwardBatch) -> RefMeta:
        dev, bsz = fb.input_ids.device, fb.batch_size
        assert fb.mode == ForwardMode.DECODE and all(n == 1 for n in fb.extend_lens), "a tail is for decode"
        assert fb.draft_tail is not None, "tail metadata is for a batch with a draft tail"
        width = max(fb.prefix_lens)
        kv_index = torch.cat([fb.req_to_token[fb.req_rows, :width], fb.draft_tail.to(dev)], dim=1)
        q_index = torch.arange(bsz, device=dev)[:, None]
        mask = None
        if min(fb.prefix_lens) != width:  # ragged prefixes: hide row columns past each prefix
            j = torch.arange(kv_index.shape[1], device=dev)
            prefix = torch.tensor(fb.prefix_lens, device=dev)
            mask = ((j[None, :] < prefix[:, None]) | (j[None, :] >= width))[:, None, None, :]
        return RefMeta(kv_index, q_index, torch.ones(bsz, dtype=torch.bool, device=dev), mask)

    @staticmethod
    def _build_mask(fb: ForwardBatch, prefix: torch.Tensor, new: torch.Tensor,
                    q_valid: torch.Tensor, max_new: int, max_kv: int) -> torch.Tensor:
        dev = prefix.device
        j = torch.arange(max_kv, device=dev)[None, None, :]  # [1, 1, max_kv]
        i = torch.arange(max_new, device=dev)[None, :, None]  # [1, max_new, 1]
        rel = j - prefix[:, None, None]  # key position relative to the first new token
        in_prefix = rel < 0
        in_new = (rel >= 0) & (rel < new[:, None, None])
        if fb.custom_masks is None:
            new_ok = rel <= i
        else:
            new_ok = torch.zeros(len(new), max_new, max_kv, dtype=torch.bool, device=dev)
            for b, m in enumerate(fb.custom_masks):
                n, p = m.shape[0], fb.prefix_lens[b]
                new_ok[b, :n, p:p + n] = m.to(dev)
        mask = in_prefix | (in_new & new_ok)
        mask &= q_valid[:, :, None]
        mask[:, :, 0] |= ~q_valid  # padded query rows: attend to key 0 to avoid NaN
        return mask[:, None]

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int,
                fb: ForwardBatch, scale: float) -> torch.Tensor:
        if k is not None:  # else stored by the caller (pooled_kv)
            assert v is not None, "k and v come together"
            fb.kv_pool.write(layer_id, fb.out_slots, k, v)
        m = cast(RefMeta, fb.attn_meta)  # set by init_forward_metadata / init_tail_metadata
        bsz, max_new = m.q_index.shape
        heads, dim = q.shape[1], q.shape[2]
        flat = m.kv_index.view(-1)  # index_select: ~3x cheaper than advanced indexing on CPU
        kv_shape = (bsz, m.kv_index.shape[1], -1, dim)
        pool = fb.kv_pool
        keys = dequantize(pool.k[layer_id].index_select(0, flat), pool.k_scale, q.dtype)
        vals = dequantize(pool.v[layer_id].index_select(0, flat), pool.v_scale, q.dtype)
        keys = keys.view(kv_shape).transpose(1, 2)  # [B, kvH, max_kv, D]
        vals = vals.view(kv_shape).transpose(1, 2)
        if q.shape[0] == bsz * max_new:  # no padding: a reshape, not a gather
            qp = q.reshape(bsz, max_new, heads, dim).transpose(1, 2)  # [B, H, max_new, D]
        else:
            qp = q[m.q_index].transpose(1, 2)
        if self.float64:
            qp, keys, vals = qp.double(), keys.double(), vals.double()
        out = F.scaled_dot_product_attention(qp, keys, vals, attn_mask=m.mask, scale=scale,
                                             enable_gqa=heads != keys.shape[1]).to(q.dtype)
        out = out.transpose(1, 2).reshape(bsz * max_new, heads * dim)  # [B*max_new, H*D]
        if out.shape[0] == q.shape[0]:  # no padding: rows are already the packed tokens
            return out
        return out[m.q_valid]
