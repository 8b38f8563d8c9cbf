"""The interface of verify-length policies: how many draft tokens each request verifies."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from dspark.engine.outputs import StepStats

Confidences = torch.Tensor | np.ndarray | None  # [R, gamma]; the engine passes a float64 host array


class VerifyPolicy(ABC):
    """Chooses l_r in [0, gamma] for each of R requests from the drafter's confidences."""

    name: str = "base"
    fallbacks: int = 0  # steps so far whose confidences were unusable (the step's statistics flag them)

    @abstractmethod
    def verify_lengths(self, confidences: Confidences, gamma: int, num_requests: int) -> torch.Tensor:
        """Return verify lengths [R] int64 from `confidences` (None: the drafter gives none)."""

    def max_length(self, gamma: int, num_requests: int = 1) -> int:
        """The longest verify length this policy can choose this step for `num_requests` requests
        with a block of `gamma`: the engine drafts no further (and not at all when it is 0)."""
        return gamma

    def observe_step(self, stats: StepStats) -> None:  # noqa: B027 - optional hook
        """What a decode-only engine step measured: the verification forward's batch and time,
        drafting (whether, how long), the rest of the step, predicted and accepted draft tokens."""
