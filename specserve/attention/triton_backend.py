"""The Triton attention backend: the reference backend's semantics in two kernels.

Owns per-forward metadata (`TritonMeta`, built once per forward from the host-side lists
of the ForwardBatch, with no device->host sync) and the CUDA-graph static buffers for
DECODE. The kernels live in `triton_decode.py` (one query per request, split-KV) and
`triton_extend.py` (ragged queries, causal or custom mask); both are imported on first
construction, so this package imports without triton installed.

Which kernel: the decode kernel whenever every request has exactly one new token and no
custom mask (DECODE, and one-token EXTEND / DRAFT_EXTEND batches); the short-extend kernel
(`triton_verify.py`, split over the keys) when every request has a few new tokens (VERIFY
trees, EAGLE's draft extend after a verify); the extend kernel otherwise (prefill).

CUDA graphs (DECODE; VERIFY and DRAFT_EXTEND are described at `_VerifyBuffers`; one
request's EXTEND, a prefill graph, at `init_prefill_graph_state`).
`init_cuda_graph_state(max_bs, 1)` allocates the static
seq_lens [max_bs] int32; capture and replay point `fb.attn_meta` at its first `bs`
entries and read req_rows straight from the caller's static `fb.req_rows`. Padding
convention: the caller pads the batch to the captured size with rows of prefix_len 0
(so seq_len 1), out_slot 0 (the scratch slot) and any valid table row (the graph runner
repeats the first real row). Such a row attends to the one key at column 0 of that row;
its output is garbage-but-finite and is dropped. The number of KV splits depends only on
(batch size, kv heads), so capture and replay launch the same grid.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from specserve.attention.base import AttentionBackend
from specserve.core.forward_batch import ForwardBatch, ForwardMode


@dataclass
class TritonMeta:
    req_rows: torch.Tensor  # [B] int64 rows of req_to_token
    seq_lens: torch.Tensor | None  # [B] int32 prefix + 1 (decode kernel only; None with a tail)
    num_splits: int  # decode and short extends: KV splits per (request, kv head)
    # extend kernel only:
    prefix_lens: torch.Tensor | None = None  # [B] int32
    extend_lens: torch.Tensor | None = None  # [B] int32
    q_starts: torch.Tensor | None = None  # [B] int32 first row of request b in the T tokens
    max_extend: int = 1
    mask: torch.Tensor | None = None  # flat uint8 custom masks, row-major [n_b, n_b] each
    mask_indptr: torch.Tensor | None = None  # [B] int64 offset of request b's mask
    # decode with a draft tail (tree drafting): keys >= tail_start[b] come from tail[b]
    tail: torch.Tensor | None = None  # [B, d] int64
    tail_start: torch.Tensor | None = None  # [B] int32 or int64; the keys are [0, tail_start + d)

    @property
    def is_decode(self) -> bool:
        return self.prefix_lens is None


class TritonBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, device: torch.device | str | None = None, num_kv_splits: int | None = None) -> None:
        """`device`: where the CUDA-graph buffers live (default: the current CUDA device, else
        CPU). `num_kv_splits`: fix the decode split count (default: a heuristic, see below)."""
        from specserve.attention import triton_decode, triton_extend, triton_verify  # imports triton

        self._decode, self._extend, self._short = triton_decode, triton_extend, triton_verify
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.num_kv_splits = num_kv_splits
        self._num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                         if self.device.type == "cuda" else 1)
        self._graph_seq_lens: torch.Tensor | None = None
        self._verify: dict[int, _VerifyBuffers] = {}  # N -> graph state of N tokens per request
        self._prefill_lens: torch.Tensor | None = None  # [3] int32: prefix, extend, q_start 0

    # -- per forward ------------------------------------------------------------------
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        fb.settle_prefix()
        dev = fb.input_ids.device
        if fb.draft_tail is not None:
            self.init_tail_metadata(fb, _to_device([fb.prefix_lens], dev)[0])
            return
        rows = fb.req_rows.to(dev, non_blocking=True)
        if fb.custom_masks is None and all(n == 1 for n in fb.extend_lens):
            seq = _to_device([[p + 1 for p in fb.prefix_lens]], dev)[0]
            fb.attn_meta = TritonMeta(rows, seq, self._num_splits(fb))
            return
        starts = [0]
        for n in fb.extend_lens[:-1]:
            starts.append(starts[-1] + n)
        prefix, extend, q_starts = _to_device([fb.prefix_lens, fb.extend_lens, starts], dev)
        mask, indptr = _pack_masks(fb, dev) if fb.custom_masks is not None else (None, None)
        fb.attn_meta = TritonMeta(rows, None, self._num_splits(fb), prefix, extend, q_starts, max(fb.extend_lens),
                                  mask, indptr)

    def init_tail_metadata(self, fb: ForwardBatch, tail_start: torch.Tensor) -> None:
        """Metadata for a DECODE batch with a draft tail from device tensors only (no host
        list is read), so tree drafting can build it inside a captured graph; tail_start
        [B] is fb.prefix_lens on the device."""
        # no launch of its own: the decode kernel adds the tail's width to tail_start itself
        assert fb.draft_tail is not None, "tail metadata is for a batch with a draft tail"
        fb.attn_meta = TritonMeta(fb.req_rows, None, self._num_splits(fb), tail=fb.draft_tail.contiguous(),
                                  tail_start=tail_start)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int,
                fb: ForwardBatch, scale: float) -> torch.Tensor:
        if k is not None:  # else stored by the caller (pooled_kv)
            assert v is not None, "k and v come together"
            fb.kv_pool.write(layer_id, fb.out_slots, k, v)
        m = cast(TritonMeta, fb.attn_meta)  # set by this backend's init_*metadata* for this batch
        k_pool, v_pool = fb.kv_pool.k[layer_id], fb.kv_pool.v[layer_id]
        ks, vs = fb.kv_pool.k_scale, fb.kv_pool.v_scale  # an fp8 pool's scales
        assert q.shape[1] % k_pool.shape[1] == 0, "query heads must be a multiple of kv heads"
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D]
        if m.is_decode:
            self._decode.decode_attention(q, k_pool, v_pool, out, fb.req_to_token, m.req_rows,
                                          m.seq_lens, scale, m.num_splits, m.tail, m.tail_start, k_scale=ks, v_scale=vs)
            return out.view(q.shape[0], -1)  # [T, H*D]
        prefix, extend, q_starts = m.prefix_lens, m.extend_lens, m.q_starts
        assert prefix is not None and extend is not None and q_starts is not None  # extend metadata has all three
        if self._short.fits(m.max_extend, q.shape[1] // k_pool.shape[1]):
            self._short.short_extend_attention(q, k_pool, v_pool, out, fb.req_to_token, m.req_rows,
                                               prefix, extend, q_starts, m.max_extend,
                                               scale, m.num_splits, m.mask, m.mask_indptr, k_scale=ks, v_scale=vs)
        else:
            self._extend.extend_attention(q, k_pool, v_pool, out, fb.req_to_token, m.req_rows,
                                          prefix, extend, q_starts, m.max_extend,
                                          scale, m.mask, m.mask_indptr, k_scale=ks, v_scale=vs)
        return out.view(q.shape[0], -1)  # [T, H*D]

    def _num_splits(self, fb: ForwardBatch) -> int:
        """Split KV until about two programs per SM (1 when the batch alone fills the GPU);
        decode and short extends alike.

        A function of (batch size, kv heads) only, never of lengths, so a captured graph
        stays right for every length. Short sequences leave trailing splits empty (cheap)."""
        if self.num_kv_splits is not None:
            return self.num_kv_splits
        programs = fb.batch_size * fb.kv_pool.k[0].shape[1]
        return max(1, min(self._decode.MAX_SPLITS, -(-2 * self._num_sms // programs)))

    # -- CUDA graphs (DECODE; VERIFY with N tokens per request) ---------------------------
    def init_cuda_graph_state(self, max_bs: int, max_tokens_per_req: int, causal: bool = False) -> None:
        """Static buffers for graphs of up to max_bs requests. max_tokens_per_req 1: DECODE;
        N > 1: every request padded to exactly N new tokens: VERIFY with an [N, N] tree mask
        rewritten per replay, or with `causal` a DRAFT_EXTEND (a chain: no mask). Each N
        keeps its own (EAGLE's step graphs verify the main tree and the batch tree)."""
        dev, n = self.device, max_tokens_per_req
        if n == 1:
            self._graph_seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
            return
        idx = torch.arange(max_bs, dtype=torch.int64, device=dev)
        self._verify[n] = _VerifyBuffers(
            n=n, prefix_lens=torch.zeros(max_bs, dtype=torch.int32, device=dev),
            extend_lens=torch.full((max_bs,), n, dtype=torch.int32, device=dev),
            q_starts=(idx * n).to(torch.int32),
            mask=None if causal else torch.ones(max_bs * n * n, dtype=torch.uint8, device=dev),
            mask_indptr=None if causal else idx * n * n)

    def verify_prefix_buffer(self, n: int) -> torch.Tensor | None:
        """The int32 prefix lengths [max_bs] that graphs of n new tokens per request read
        (None before init_cuda_graph_state(.., n)): a caller that writes them itself passes
        this buffer as the batch's device_prefix, and no copy is launched."""
        vb = self._verify.get(n)
        return vb.prefix_lens if vb is not None else None

    def verify_mask_buffer(self, n: int) -> torch.Tensor | None:
        """The tree masks [max_bs, n, n] (bool view of the uint8 bytes) that graphs of n
        new tokens per request read (None before init_cuda_graph_state(.., n) or when
        causal): a caller that keeps its trees' masks here passes them as the batch's
        custom masks, and no copy is launched."""
        vb = self._verify.get(n)
        return vb.mask.view(torch.bool).view(-1, n, n) if vb is not None and vb.mask is not None else None

    def init_prefill_graph_state(self, max_reqs: int = 1) -> None:
        """Static metadata for graphs of up to `max_reqs` requests' EXTEND
        (runner/prefill_graphs.py): each request's prefix, true extend length and first
        query row are rewritten per replay, while the grid follows the captured token and
        request counts, so query rows past a request's true length (padding) are never
        computed and never seen as keys, and a padding request (extend 0) computes nothing."""
        self._prefill_lens = torch.zeros(3, max_reqs, dtype=torch.int32, device=self.device)

    def init_metadata_for_capture(self, fb: ForwardBatch) -> None:
        self._check_graph_batch(fb)
        self.init_metadata_for_replay(fb)  # the same static slices, filled with fb's lengths

    def init_metadata_for_replay(self, fb: ForwardBatch) -> None:
        """Write lengths (and VERIFY masks) in place; fb.req_rows is already static. Runs
        outside the captured region (it copies from host memory)."""
        bs = fb.batch_size
        if fb.mode == ForwardMode.EXTEND:
            self._prefill_metadata(fb)
            return
        if fb.mode in _FIXED_N_MODES:
            vb = self._verify[fb.extend_lens[0]]
            prefix = vb.prefix_lens[:bs]
            device_prefix = fb.device_prefix  # a pipelined step: lengths exist on the device only
            if device_prefix is None:
                prefix.copy_(torch.tensor(fb.prefix_lens, dtype=torch.int32), non_blocking=True)
            elif device_prefix.data_ptr() != prefix.data_ptr():  # else its writer wrote them here
                prefix.copy_(device_prefix)
            if fb.custom_masks is not None and vb.mask is not None:  # capture runs with full masks (all ones)
                masks = fb.custom_masks
                flat = (masks if isinstance(masks, torch.Tensor) else torch.stack(list(masks))).reshape(-1)
                if flat.data_ptr() != vb.mask.data_ptr():  # else its writer keeps them here
                    vb.mask[:flat.numel()].copy_(flat, non_blocking=True)  # bool -> uint8 in the copy
            fb.attn_meta = TritonMeta(fb.req_rows, None, self._num_splits(fb), prefix, vb.extend_lens[:bs],
                                      vb.q_starts[:bs], vb.n,
                                      vb.mask, vb.mask_indptr[:bs] if vb.mask_indptr is not None else None)
            return
        assert fb.device_prefix is None, "DECODE graphs take host lengths"
        assert self._graph_seq_lens is not None, "init_cuda_graph_state(max_bs, 1) comes first"
        seq = self._graph_seq_lens[:bs]
        seq.copy_(torch.tensor([p + 1 for p in fb.prefix_lens], dtype=torch.int32, device="cpu"), non_blocking=True)
        fb.attn_meta = TritonMeta(fb.req_rows, seq, self._num_splits(fb))

    def _prefill_metadata(self, fb: ForwardBatch) -> None:
        """The EXTEND of fb.batch_size requests (padding ones: extend 0) over
        fb.input_ids.numel() static rows, of which the first sum(fb.extend_lens) are real."""
        lens, r = self._prefill_lens, fb.batch_size
        assert lens is not None, "init_prefill_graph_state comes first"
        starts = [0]
        for n in fb.extend_lens[:-1]:
            starts.append(starts[-1] + n)
        lens[:, :r].copy_(torch.tensor([fb.prefix_lens, fb.extend_lens, starts], dtype=torch.int32), non_blocking=True)
        fb.attn_meta = TritonMeta(fb.req_rows, None, self._num_splits(fb), lens[0, :r], lens[1, :r], lens[2, :r],
                                  fb.input_ids.numel())

    def _check_graph_batch(self, fb: ForwardBatch) -> None:
        if fb.mode == ForwardMode.EXTEND:
            if self._prefill_lens is None or fb.batch_size > self._prefill_lens.shape[1] \
                    or fb.custom_masks is not None:
                raise RuntimeError("EXTEND graphs need init_prefill_graph_state(max_reqs) and causal requests")
            return
        if fb.mode in _FIXED_N_MODES:
            n = fb.extend_lens[0]
            if n not in self._verify or any(m != n for m in fb.extend_lens):
                raise RuntimeError(f"{fb.mode.value} graphs need init_cuda_graph_state(max_bs, N) and N tokens "
                                   "per request")
            if (self._verify[n].mask is None) != (fb.mode == ForwardMode.DRAFT_EXTEND):
                raise RuntimeError("VERIFY graphs need a tree mask, DRAFT_EXTEND graphs a causal state")
            return
        if self._graph_seq_lens is None:
            raise RuntimeError("call init_cuda_graph_state before capturing")
        if fb.mode != ForwardMode.DECODE or fb.custom_masks is not None or any(n != 1 for n in fb.extend_lens):
            raise ValueError(f"TritonBackend captures DECODE, VERIFY, DRAFT_EXTEND and causal EXTEND "
                             f"graphs, not {fb.mode.value}")
        if fb.batch_size > self._graph_seq_lens.numel():
            raise ValueError(f"batch {fb.batch_size} exceeds the graph state's max_bs {self._graph_seq_lens.numel()}")


class InvariantTritonBackend(TritonBackend):
    """The same metadata, graphs and buffers, with one kernel pair for every mode
    (`triton_invariant.py`): a query's output does not depend on the forward mode or the
    batch (--enable-deterministic-inference)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int,
                fb: ForwardBatch, scale: float) -> torch.Tensor:
        from specserve.attention.triton_invariant import invariant_attention

        if k is not None:  # else stored by the caller (pooled_kv)
            assert v is not None, "k and v come together"
            fb.kv_pool.write(layer_id, fb.out_slots, k, v)
        pool = fb.kv_pool
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D]
        invariant_attention(q, pool.k[layer_id], pool.v[layer_id], out, fb.req_to_token,
                            cast(TritonMeta, fb.attn_meta), scale, k_scale=pool.k_scale, v_scale=pool.v_scale)
        return out.view(q.shape[0], -1)  # [T, H*D]


_FIXED_N_MODES = (ForwardMode.VERIFY, ForwardMode.DRAFT_EXTEND)


@dataclass
class _VerifyBuffers:
    """Static extend-kernel metadata for graphs of n new tokens per request (VERIFY, or a
    causal DRAFT_EXTEND): request b owns query rows [b*n, (b+1)*n) and, with a tree mask,
    mask bytes [b*n*n, (b+1)*n*n)."""

    n: int
    prefix_lens: torch.Tensor  # [max_bs] int32, rewritten per replay
    extend_lens: torch.Tensor  # [max_bs] int32, all n
    q_starts: torch.Tensor  # [max_bs] int32
    mask: torch.Tensor | None  # [max_bs * n * n] uint8, rewritten per replay; None: causal
    mask_indptr: torch.Tensor | None  # [max_bs] int64


def _to_device(lists: list[list[int]], dev: torch.device) -> torch.Tensor:
    """Host int lists -> one [len(lists), B] int32 tensor on `dev`, in one async copy.

    non_blocking from pageable memory: CUDA stages the bytes before returning, so the
    temporary may die at once, and no stream sync is issued."""
    return torch.tensor(lists, dtype=torch.int32, device="cpu").to(dev, non_blocking=True)


def _pack_masks(fb: ForwardBatch, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat uint8 of all [n_b, n_b] masks row-major, int64 [B] offsets), like SGLang's mask_indptr."""
    masks = fb.custom_masks
    assert masks is not None, "only a batch with custom masks packs them"
    offsets, total = [], 0
    for m, n in zip(masks, fb.extend_lens):
        assert tuple(m.shape) == (n, n), f"custom mask {tuple(m.shape)} for {n} new tokens"
        offsets.append(total)
        total += n * n
    flat = torch.cat([m.reshape(-1).to(dev, non_blocking=True) for m in masks]).to(torch.uint8)
    return flat, torch.tensor(offsets, dtype=torch.int64, device="cpu").to(dev, non_blocking=True)
