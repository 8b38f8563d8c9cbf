"""Cached prefixes moved out of their KV slots: K/V in a pool of fixed-size blocks beside the cache.

A slot about to hold another request's tokens saves its cached prefix here as one entry (the
blocks of one prompt's prefix, not shared between entries); a later prompt starting with it is
copied back into a slot. Entries are evicted least recently used first. The pool lives on the
cache's device and every copy is one indexed tensor copy per K and V, the same code on the CPU
and CUDA.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import torch

from dspark.models.kv_cache import KVCache


class PrefixStore:
    """Entries of whole blocks in a pool of `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, cache: KVCache, num_blocks: int, block_size: int) -> None:
        layers, _, kv_heads, _, head_dim = cache.k.shape
        shape = (layers, num_blocks, kv_heads, block_size, head_dim)
        # Uninitialised: only blocks written by `save` are ever read back (on the CPU, pages are
        # only committed as they are written).
        self.k = torch.empty(shape, dtype=cache.k.dtype, device=cache.k.device)
        self.v = torch.empty(shape, dtype=cache.v.dtype, device=cache.v.device)
        self.cache = cache
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._entries: OrderedDict[int, list[int]] = OrderedDict()  # entry -> its blocks; LRU first
        self._ids = itertools.count()

    @staticmethod
    def blocks_for(budget_bytes: int, bytes_per_token: int, block_size: int) -> int:
        return budget_bytes // (bytes_per_token * block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def __len__(self) -> int:
        return len(self._entries)

    def oldest(self) -> int | None:
        """The least recently used entry, the next to evict."""
        return next(iter(self._entries), None)

    def save(self, slot: int, length: int) -> int:
        """Copy the slot's first `length` tokens (whole blocks) into a new entry; the caller has
        made room (`num_free_blocks`)."""
        n = length // self.block_size
        if n > len(self._free):
            raise RuntimeError(f"the prefix store has {len(self._free)} free blocks, not {n}")
        blocks = [self._free.pop() for _ in range(n)]
        index = torch.tensor(blocks, device=self.k.device)
        for pool, source in ((self.k, self.cache.k), (self.v, self.cache.v)):
            # [layers, kv_heads, n * block, hd] -> [layers, n, kv_heads, block, hd]
            rows = source[:, slot, :, : n * self.block_size].unflatten(2, (n, self.block_size))
            pool[:, index] = rows.transpose(1, 2)
        entry = next(self._ids)
        self._entries[entry] = blocks
        return entry

    def load(self, entry: int, slot: int, length: int) -> None:
        """Copy the entry's first `length` tokens (whole blocks) into the slot; marks it used."""
        n = length // self.block_size
        index = torch.tensor(self._entries[entry][:n], device=self.k.device)
        for pool, dest in ((self.k, self.cache.k), (self.v, self.cache.v)):
            dest[:, slot, :, : n * self.block_size] = pool[:, index].transpose(1, 2).flatten(2, 3)
        self._entries.move_to_end(entry)

    def drop(self, entry: int) -> None:
        self._free.extend(reversed(self._entries.pop(entry)))
