"""Verify-length policies' interface, the guard of those reading confidences c[r, k] = P(draft k+1
accepted | all before it accepted), and survival a[r, j] = prod_{i<=j} c[r, i]. NumPy on the host,
not torch: R x gamma is tiny, and on this per-step critical path a small NumPy op costs about a
microsecond where a CPU torch op costs five to ten."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dspark.engine.outputs import StepStats

logger = logging.getLogger(__name__)

Confidences = torch.Tensor | np.ndarray | None  # [R, gamma]; the engine passes a float64 host array
FALLBACK_LENGTH = 3


def host_array(confidences: torch.Tensor | np.ndarray) -> np.ndarray:
    """Confidences as a float64 NumPy array on the host (one device copy for a tensor)."""
    if isinstance(confidences, torch.Tensor):
        # Through a list: between two forwards (caches cold) a torch dtype conversion takes 90 us.
        return np.array(confidences.detach().tolist(), dtype=np.float64).reshape(confidences.shape)
    return np.asarray(confidences, dtype=np.float64)


def survival_probabilities(confidences: torch.Tensor | np.ndarray) -> np.ndarray:
    """a[r, j] = prod_{i<=j} c[r, i] in float64; confidences are clamped into [0, 1] first."""
    return np.cumprod(np.clip(host_array(confidences), 0.0, 1.0), axis=1)


@dataclass(frozen=True)
class VerifyChoice:
    """A step's verify lengths, and whether unusable confidences made them a fixed fallback."""

    lengths: torch.Tensor  # [R] CPU int64, each in [0, gamma]
    fallback: bool = False


class VerifyPolicy(ABC):
    """Chooses l_r in [0, gamma] for each of R requests from the drafter's confidences."""

    name: str = "base"
    fallbacks: int = 0  # steps so far whose confidences were unusable (the step's statistics flag them)

    @abstractmethod
    def choose(self, confidences: Confidences, gamma: int, num_requests: int) -> VerifyChoice:
        """Verify lengths [R] from `confidences` (None: the drafter gives none)."""

    def verify_lengths(self, confidences: Confidences, gamma: int, num_requests: int) -> torch.Tensor:
        """The lengths of `choose`."""
        return self.choose(confidences, gamma, num_requests).lengths

    def max_length(self, gamma: int, num_requests: int = 1) -> int:
        """The longest verify length this policy can choose this step for `num_requests` requests
        with a block of `gamma`: the engine drafts no further (and not at all when it is 0)."""
        return gamma

    def observe_step(self, stats: StepStats) -> None:  # noqa: B027 - optional hook
        """What a decode-only engine step measured: the verification forward's batch and time,
        drafting (whether, how long), the rest of the step, predicted and accepted draft tokens."""


class ConfidenceGuard:
    """Hands a policy's ranking only usable confidences: without them (None, NaN, inf) a step verifies
    min(FALLBACK_LENGTH, gamma) tokens per request, lossless whatever the drafter did; one warning is
    logged per burst of such steps."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.fallbacks = 0
        self._in_fallback = False

    def choose(
        self,
        confidences: Confidences,
        gamma: int,
        num_requests: int,
        lengths: Callable[[np.ndarray], torch.Tensor],
    ) -> VerifyChoice:
        """`lengths` of finite float64 confidences [R, gamma] (R and gamma >= 1), else the fallback."""
        shape = None if confidences is None else tuple(confidences.shape)
        if shape not in (None, (num_requests, gamma)):
            raise ValueError(f"{self.name}: confidences have shape {shape}, expected {(num_requests, gamma)}")
        if num_requests == 0 or gamma == 0:
            return VerifyChoice(torch.zeros(num_requests, dtype=torch.int64))
        confidences = None if confidences is None else host_array(confidences)
        if confidences is not None and np.isfinite(confidences).all():
            if self._in_fallback:
                logger.info("%s: confidences usable again, leaving the static fallback", self.name)
                self._in_fallback = False
            return VerifyChoice(lengths(confidences))
        self.fallbacks += 1
        length = min(FALLBACK_LENGTH, gamma)
        if not self._in_fallback:
            what = "no confidences" if confidences is None else "NaN or inf in the confidences"
            logger.warning("%s: %s; verifying a static %d tokens per request", self.name, what, length)
            self._in_fallback = True
        return VerifyChoice(torch.full((num_requests,), length, dtype=torch.int64), fallback=True)
