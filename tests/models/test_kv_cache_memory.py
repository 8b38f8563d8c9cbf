"""The CPU KV cache commits memory only as requests write it."""

from __future__ import annotations

import psutil
import torch
from dspark.models.kv_cache import KVCache

CPU = torch.device("cpu")


def test_an_unwritten_cache_takes_no_memory_and_reads_zero():
    rss = psutil.Process().memory_info().rss
    cache = KVCache(8, 16, 2048, 4, 64, torch.float32, CPU)  # 2 x 256 MiB
    assert psutil.Process().memory_info().rss - rss < 32 * 2**20
    assert cache.k.shape == (8, 16, 4, 2048, 64) and cache.k.is_contiguous()
    cache.k[:, 3, :, :10] = 1.5
    assert cache.k[:, 3, :, :10].eq(1.5).all() and cache.k[:, 3, :, 10:12].eq(0).all()
    assert cache.v[:, 4, :, :12].eq(0).all() and cache.k[:, 15, :, -2:].eq(0).all()
    # One slot's writes commit its pages (2 MiB ones under transparent huge pages), not the cache.
    assert psutil.Process().memory_info().rss - rss < 128 * 2**20
