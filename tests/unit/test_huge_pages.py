"""kernels/huge_pages.py: a copy holds the same bytes, small tensors share 2 MiB-aligned
chunks, a large one gets its own mapping, and a copy outlives everything but its views."""
from __future__ import annotations

import gc

import pytest
import torch

from specserve.kernels import huge_pages

needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages on this system")


@needs_thp
def test_copies_hold_the_same_values_in_aligned_chunks(monkeypatch):
    monkeypatch.setattr(huge_pages, "_open", [])  # a fresh chunk, whatever ran before
    small = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (1, 4095, 4096, 70000)]
    copies = [huge_pages.copy(t) for t in small]
    for t, c in zip(small, copies):
        assert torch.equal(t, c) and c.data_ptr() != t.data_ptr() and c.data_ptr() % huge_pages.ALIGN == 0
    assert copies[1].data_ptr() - copies[0].data_ptr() == huge_pages.ALIGN  # one chunk, packed in turn
    big = torch.randn(huge_pages.CHUNK // 4 + 1, dtype=torch.float32)  # 4 bytes an element: its own mapping
    copied = huge_pages.copy(big.reshape(-1, 1))
    assert copied.shape == (big.numel(), 1) and copied.dtype == torch.float32
    assert torch.equal(copied.view(-1), big) and copied.data_ptr() % huge_pages.HUGE == 0


@needs_thp
def test_a_copy_outlives_its_chunk_object():
    src = torch.arange(huge_pages.CHUNK // 2, dtype=torch.uint8)  # past CHUNK / 4: a chunk of its own
    kept = huge_pages.copy(src)
    gc.collect()
    assert torch.equal(kept, src)


def test_without_huge_pages_a_tensor_stays_as_it_was(monkeypatch):
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    t = torch.ones(10)
    assert huge_pages.copy(t) is t
    assert huge_pages.copy(torch.empty(0)).numel() == 0


@needs_thp
def test_chunks_made_in_inference_mode_serve_outside_it(monkeypatch):
    monkeypatch.setattr(huge_pages, "_open", [])
    with torch.inference_mode():
        first = huge_pages.copy(torch.ones(8, dtype=torch.uint8))  # opens the chunk
    second = huge_pages.copy(torch.full((8,), 2, dtype=torch.uint8))  # the same chunk, outside the mode
    assert not first.is_inference() and first.sum() == 8 and second.sum() == 16
