"""Per-request drafter context (e.g. each draft layer's context K/V) in paged device buffers.

Every named buffer is a pool of pages [num_pages, page_size, *entry_shape]; each admitted request
owns a row of a page table, so memory follows the tokens actually committed (not rows x longest
request) and a batch of requests is read with one gather. Pools grow by doubling. Only committed
tokens are ever written, so nothing needs rolling back.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


class ContextStore:
    def __init__(
        self,
        entry_shapes: dict[str, tuple[int, ...]],
        device: torch.device,
        dtype: torch.dtype,
        page_size: int = 64,
    ) -> None:
        self.entry_shapes = dict(entry_shapes)
        self.device, self.dtype, self.page_size = device, dtype, page_size
        self.length: dict[str, int] = {}  # committed tokens per request
        self._row: dict[str, int] = {}
        self._pages: dict[str, list[int]] = {}
        self._free_rows: list[int] = []
        self._free_pages: list[int] = []
        self._pools: dict[str, torch.Tensor] = {}
        self._table = torch.zeros(0, 0, dtype=torch.long, device=device)  # [rows, pages per row] -> page id
        self._grow_table(rows=8, cols=4)
        self._grow_pools(pages=32)

    def admit(self, request_id: str) -> None:
        if request_id in self._row:
            raise ValueError(f"request {request_id!r} is already admitted to the drafter")
        if not self._free_rows:
            self._grow_table(rows=2 * self._table.shape[0], cols=self._table.shape[1])
        self._row[request_id] = self._free_rows.pop()
        self._pages[request_id] = []
        self.length[request_id] = 0

    def release(self, request_id: str) -> None:
        row = self._row.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)
            self._free_pages.extend(self._pages.pop(request_id))
            del self.length[request_id]

    def rename(self, old: Hashable, new: Hashable) -> None:
        """Key `old`'s context as `new` (a finished request's context kept under its slot)."""
        if new in self._row:
            raise ValueError(f"{new!r} already has context in the drafter")
        self._row[new] = self._row.pop(old)
        self._pages[new] = self._pages.pop(old)
        self.length[new] = self.length.pop(old)

    @torch.inference_mode()  # the tables may have grown in inference mode (commits run in it)
    def copy_prefix(self, source: Hashable, dest: Hashable, length: int) -> None:
        """Give `dest` (just admitted) a copy of `source`'s first `length` entries."""
        if length > self.length[source]:
            raise ValueError(f"{source!r} holds {self.length[source]} context entries, not {length}")
        self.reserve(dest, length)
        src, dst = (torch.tensor([self._row[k]], device=self.device) for k in (source, dest))
        positions = torch.arange(length, device=self.device)
        for name in self.entry_shapes:
            self.write(name, dst, positions, self.read(name, src, length)[0])
        self.length[dest] = length

    def rows(self, request_ids: Sequence[str]) -> list[int]:
        missing = [rid for rid in request_ids if rid not in self._row]
        if missing:
            raise KeyError(f"requests {missing} were not admitted to the drafter (call admit first)")
        return [self._row[rid] for rid in request_ids]

    def reserve(self, request_id: str, length: int) -> None:
        """Give the request pages for positions < length."""
        pages = self._pages[request_id]
        needed = -(-length // self.page_size) - len(pages)
        if needed <= 0:
            return
        if needed > len(self._free_pages):
            self._grow_pools(pages=max(2 * self._num_pages, self._num_pages + needed))
        if len(pages) + needed > self._table.shape[1]:
            self._grow_table(
                rows=self._table.shape[0], cols=max(2 * self._table.shape[1], len(pages) + needed)
            )
        new = [self._free_pages.pop() for _ in range(needed)]
        row = self._row[request_id]
        self._table[row, len(pages) : len(pages) + needed] = torch.tensor(new, device=self.device)
        pages.extend(new)

    def write(self, name: str, rows: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
        """values [..., *entry] at (rows, positions) of matching (broadcastable) shape [...]."""
        page = self._table[rows, positions // self.page_size]
        self._pools[name][page, positions % self.page_size] = values.to(self.dtype)

    def read(self, name: str, rows: torch.Tensor, length: int) -> torch.Tensor:
        """[R, length, *entry] for rows [R]; entries past a request's own length are garbage, mask them."""
        n_pages = -(-length // self.page_size)
        pages = self._pools[name][self._table[rows, :n_pages]]  # [R, n_pages, page, *entry]
        return pages.flatten(1, 2)[:, :length]

    def read_at(self, name: str, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Entries at positions [R, S] of rows [R] -> [R, S, *entry]."""
        page = self._table[rows[:, None], positions // self.page_size]
        return self._pools[name][page, positions % self.page_size]

    @property
    def _num_pages(self) -> int:
        return next(iter(self._pools.values())).shape[0] if self._pools else 0

    def _grow_pools(self, pages: int) -> None:
        old = self._num_pages
        for name, shape in self.entry_shapes.items():
            pool = torch.zeros((pages, self.page_size, *shape), dtype=self.dtype, device=self.device)
            if name in self._pools:
                pool[:old] = self._pools[name]
            self._pools[name] = pool
        self._free_pages.extend(range(pages - 1, old - 1, -1))

    def _grow_table(self, rows: int, cols: int) -> None:
        old_rows, old_cols = self._table.shape
        table = torch.zeros(rows, cols, dtype=torch.long, device=self.device)
        table[:old_rows, :old_cols] = self._table
        self._table = table
        self._free_rows.extend(range(rows - 1, old_rows - 1, -1))
