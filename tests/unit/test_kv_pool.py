"""The KV pool on the CPU costs memory only for the slots that are written.

A server's pool is sized for many requests (the default model's 32k slots take 1.5 GB in
fp32), but torch.zeros writes every page. The pool's zeros are fresh anonymous pages
instead, zero until first touched, so an idle or lightly used server holds what it uses.
"""
from __future__ import annotations

import torch

from specserve.cache.kv_pool import KVPool


def _rss_mb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) // 1024


def test_an_untouched_cpu_pool_takes_no_memory():
    before = _rss_mb()
    pool = KVPool(65536, 8, 4, 64, torch.float32, "cpu")  # 2 * 8 * 65537 * 4 * 64 * 4 bytes: 1 GiB
    assert pool.k[0].shape == (65537, 4, 64) and pool.k[0].dtype == torch.float32
    assert _rss_mb() - before < 64
    slots = torch.tensor([1, 7, 65536])
    pool.write(3, slots, torch.ones(3, 4, 64), torch.full((3, 4, 64), 2.0))
    assert _rss_mb() - before < 64  # three slots written: a few pages
    assert pool.k[3][slots].eq(1).all() and pool.v[3][slots].eq(2).all()
    assert pool.k[3][:7].sum() == 4 * 64 and pool.k[2][::4096].abs().sum() == 0  # zeros elsewhere
