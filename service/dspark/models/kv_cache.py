"""Per-request KV cache slots; a slot's length lives with its request, so rollback is O(1)."""

from __future__ import annotations

import math
import mmap

import torch

from dspark.models import host_limits


class KVCache:
    """K and V for every layer as [layers, slots, kv_heads, max_len, head_dim].

    A request owns one slot; what it has cached is `request.num_cached`, so rejecting draft
    tokens only lowers that counter (their stale entries are overwritten by the next step).
    Zero-initialised: padded attention reads masked entries, and 0 x NaN from never-written
    memory would poison the output.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.k = lazy_zeros(shape, dtype, device)
        self.v = lazy_zeros(shape, dtype, device)
        self.max_len = max_len
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def free_slots(self) -> list[int]:
        return list(self._free)

    def is_free(self, slot: int) -> bool:
        return slot in self._free

    def allocate(self, slot: int | None = None) -> int:
        """The lowest never-used or last-freed slot (a steady load keeps slots adjacent), or `slot`."""
        if not self._free:
            raise RuntimeError("no free KV slot")
        if slot is None:
            return self._free.pop()
        self._free.remove(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot >= 0 and slot not in self._free:
            self._free.append(slot)

    def copy_prefix(self, source: int, dest: int, length: int) -> None:
        """Copy the first `length` positions of `source`'s K and V into `dest`."""
        self.k[:, dest, :, :length] = self.k[:, source, :, :length]
        self.v[:, dest, :, :length] = self.v[:, source, :, :length]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on the CPU in anonymous memory, which the OS backs page by page as it is written, so
    a cache sized for max_num_seqs x max_model_len holds only what requests have written (torch.zeros
    would write, and so commit, every page at once)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    pages = mmap.mmap(-1, max(1, count * dtype.itemsize))
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


def available_memory(device: torch.device) -> int:
    """Bytes the KV cache may still take on `device`."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_limits.available_memory()


def check_kv_budget(
    bytes_per_token: int, num_slots: int, max_len: int, device: torch.device, share: float = 0.9
) -> None:
    """Refuse, before allocating, a cache that would exhaust memory once it fills."""
    need, have = bytes_per_token * num_slots * max_len, available_memory(device)
    if need > share * have:
        raise ValueError(
            f"the KV cache for max_num_seqs={num_slots} x max_model_len={max_len} needs {need / 2**30:.1f} GiB, "
            f"but only {have / 2**30:.1f} GiB is available on {device}; lower max_num_seqs or max_model_len"
        )


def prefix_store_bytes(
    requested: int,
    bytes_per_token: int,
    num_slots: int,
    max_len: int,
    device: torch.device,
    share: float = 0.9,
) -> int:
    """Memory for the prefix store: as requested, but at most half of what the KV slots leave of
    `share` of the device's available memory (a default budget must not stop a smaller machine)."""
    left = share * available_memory(device) - bytes_per_token * num_slots * max_len
    return max(0, min(requested, int(left // 2)))
