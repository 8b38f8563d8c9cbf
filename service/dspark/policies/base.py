"""The interface of verify-length policies: how many draft tokens each request verifies."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class VerifyPolicy(ABC):
    """Chooses l_r in [0, gamma] for each of R requests from the drafter's confidences."""

    name: str = "base"

    @abstractmethod
    def schedule(self, confidences: torch.Tensor | None, gamma: int, num_requests: int) -> torch.Tensor:
        """Return verify lengths [R] int64; `confidences` is [R, gamma] or None."""

    def observe_step(  # noqa: B027 - optional hook
        self, batch_tokens: int, seconds: float, overhead_s: float = 0.0
    ) -> None:
        """Measured duration of a verification forward of `batch_tokens` tokens, and the rest of
        that engine step (drafting, acceptance)."""
