"""Shared handling of the drafter's confidences: shape checks and the safe fallback."""

from __future__ import annotations

import logging
from abc import abstractmethod

import numpy as np
import torch

from dspark.engine.survival import host_array
from dspark.engine.verify_policy import Confidences, VerifyPolicy

logger = logging.getLogger(__name__)

FALLBACK_LENGTH = 3


class ConfidencePolicy(VerifyPolicy):
    """A policy that needs confidences. Without usable ones (None, NaN, inf) the step verifies
    a fixed min(FALLBACK_LENGTH, gamma) tokens per request, lossless whatever the drafter did;
    `fallbacks` counts such steps and one warning is logged per burst of them. Confidences are
    ranked on the host in NumPy; lengths come back as a CPU int64 tensor."""

    def __init__(self) -> None:
        self.fallbacks = 0
        self._in_fallback = False

    def verify_lengths(self, confidences: Confidences, gamma: int, num_requests: int) -> torch.Tensor:
        if confidences is not None and tuple(confidences.shape) != (num_requests, gamma):
            raise ValueError(
                f"{self.name}: confidences have shape {tuple(confidences.shape)}, expected {(num_requests, gamma)}"
            )
        if num_requests == 0 or gamma == 0:
            return torch.zeros(num_requests, dtype=torch.int64)
        if confidences is not None:
            confidences = host_array(confidences)
        problem = self._unusable(confidences)
        if problem is not None:
            return self._fall_back(problem, gamma, num_requests)
        if self._in_fallback:
            logger.info("%s: confidences usable again, leaving the static fallback", self.name)
            self._in_fallback = False
        return self._lengths(self._prepare(confidences))

    def _prepare(self, confidences: np.ndarray) -> np.ndarray:
        """Usable confidences (float64, finite) on their way to `_lengths`: a hook for
        policies that adjust or record them."""
        return confidences

    @staticmethod
    def _unusable(confidences: np.ndarray | None) -> str | None:
        if confidences is None:
            return "the drafter gave no confidences"
        if not np.isfinite(confidences).all():
            return "confidences contain NaN or inf"
        return None

    def _fall_back(self, problem: str, gamma: int, num_requests: int) -> torch.Tensor:
        self.fallbacks += 1
        length = min(FALLBACK_LENGTH, gamma)
        if not self._in_fallback:
            logger.warning(
                "%s: %s; verifying a static %d tokens per request until they are usable",
                self.name,
                problem,
                length,
            )
            self._in_fallback = True
        self._on_fallback()
        return torch.full((num_requests,), length, dtype=torch.int64)

    def _on_fallback(self) -> None:
        """A step was scheduled by the fallback (stateful policies record the gap)."""

    @abstractmethod
    def _lengths(self, confidences: np.ndarray) -> torch.Tensor:
        """Lengths [R] (CPU int64) for finite confidences [R, gamma] (float64) with R, gamma >= 1."""
