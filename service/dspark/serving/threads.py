"""How many intra-op threads the engine's steps use, by the number of requests in the batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ThreadPlan:
    """`single` threads for a step of one request, `batch` for a step of several."""

    single: int
    batch: int

    def threads(self, num_requests: int) -> int:
        return self.single if num_requests <= 1 else self.batch

    def apply(self, num_requests: int) -> None:
        """Set torch's intra-op threads for a step of `num_requests` (a no-op when unchanged)."""
        threads = self.threads(num_requests)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
