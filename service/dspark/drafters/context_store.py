"""Per-request drafter context (e.g. context K/V of each draft layer) in growable device buffers.

Each admitted request owns one row; every named buffer is [rows, capacity, *entry_shape] and grows
by doubling, so appending a token is amortised O(1) and a batch of requests is read with one
gather. Only committed tokens are ever written, so nothing needs rolling back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ContextStore:
    def __init__(
        self, entry_shapes: dict[str, tuple[int, ...]], device: torch.device, dtype: torch.dtype
    ) -> None:
        self.entry_shapes = dict(entry_shapes)
        self.device, self.dtype = device, dtype
        self._row: dict[str, int] = {}
        self._free: list[int] = []
        self.length: dict[str, int] = {}  # committed tokens per request
        self._rows_cap, self._len_cap = 0, 0
        self._buffers: dict[str, torch.Tensor] = {}
        self._grow(rows=8, length=64)
        self._free = list(range(self._rows_cap - 1, -1, -1))  # pop() hands out low rows first

    def admit(self, request_id: str) -> None:
        if request_id in self._row:
            raise ValueError(f"request {request_id!r} is already admitted to the drafter")
        if not self._free:
            old = self._rows_cap
            self._grow(rows=2 * old, length=self._len_cap)
            self._free = list(range(self._rows_cap - 1, old - 1, -1))
        self._row[request_id] = self._free.pop()
        self.length[request_id] = 0

    def release(self, request_id: str) -> None:
        row = self._row.pop(request_id, None)
        if row is not None:
            self._free.append(row)
            del self.length[request_id]

    def rows(self, request_ids: Sequence[str]) -> list[int]:
        missing = [rid for rid in request_ids if rid not in self._row]
        if missing:
            raise KeyError(f"requests {missing} were not admitted to the drafter (call admit first)")
        return [self._row[rid] for rid in request_ids]

    def reserve(self, length: int) -> None:
        """Make room for positions < length in every row."""
        if length > self._len_cap:
            self._grow(rows=self._rows_cap, length=max(length, 2 * self._len_cap))

    def write(self, name: str, rows: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
        """values [..., *entry] at (rows, positions) of matching shape [...]."""
        self._buffers[name][rows, positions] = values.to(self.dtype)

    def read(self, name: str, rows: torch.Tensor, length: int) -> torch.Tensor:
        """[R, length, *entry] for rows [R]; entries past a request's own length are stale, mask them."""
        return self._buffers[name][rows, :length]

    def read_at(self, name: str, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Entries at positions [R, S] of rows [R] -> [R, S, *entry]."""
        return self._buffers[name][rows[:, None], positions]

    def _grow(self, rows: int, length: int) -> None:
        for name, shape in self.entry_shapes.items():
            new = torch.zeros((rows, length, *shape), dtype=self.dtype, device=self.device)
            old = self._buffers.get(name)
            if old is not None:
                new[: old.shape[0], : old.shape[1]] = old
            self._buffers[name] = new
        self._rows_cap, self._len_cap = rows, length
