"""Per-request KV cache slots; a slot's length lives with its request, so rollback is O(1)."""

from __future__ import annotations

import torch


class KVCache:
    """K and V for every layer as [layers, slots, kv_heads, max_len, head_dim].

    A request owns one slot; what it has cached is `request.num_cached`, so rejecting draft
    tokens only lowers that counter (their stale entries are overwritten by the next step).
    Memory is reserved with `torch.empty`, so untouched pages cost nothing on the host.
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
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV slot")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if slot >= 0 and slot not in self._free:
            self._free.append(slot)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
