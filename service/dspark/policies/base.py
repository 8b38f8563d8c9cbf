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

    def max_length(self, gamma: int, num_requests: int = 1) -> int:
        """The longest verify length this policy can choose this step for `num_requests` requests
        with a block of `gamma`: the engine drafts no further (and not at all when it is 0)."""
        return gamma

    def observe_step(  # noqa: B027 - optional hook
        self,
        batch_tokens: int,
        seconds: float,
        overhead_s: float = 0.0,
        draft_s: float = 0.0,
        num_drafted: int = 0,
    ) -> None:
        """Measured duration of a verification forward of `batch_tokens` tokens, the rest of that
        engine step but drafting (`overhead_s`: acceptance, caches), and drafting for
        `num_drafted` requests (`draft_s`; 0 requests when the step did not draft)."""
