"""The base of the policies that rank the drafter's confidences, with their safe fallback."""

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
    """Without usable confidences (None, NaN, inf) a step verifies min(FALLBACK_LENGTH, gamma)
    tokens per request, lossless whatever the drafter did; `fallbacks` counts such steps and one
    warning is logged per burst of them."""

    _in_fallback = False

    def verify_lengths(self, confidences: Confidences, gamma: int, num_requests: int) -> torch.Tensor:
        if confidences is not None and tuple(confidences.shape) != (num_requests, gamma):
            raise ValueError(
                f"{self.name}: confidences have shape {tuple(confidences.shape)}, expected {(num_requests, gamma)}"
            )
        if num_requests == 0 or gamma == 0:
            return torch.zeros(num_requests, dtype=torch.int64)
        confidences = None if confidences is None else host_array(confidences)
        if confidences is not None and np.isfinite(confidences).all():
            if self._in_fallback:
                logger.info("%s: confidences usable again, leaving the static fallback", self.name)
                self._in_fallback = False
            return self._lengths(confidences)
        self.fallbacks += 1
        length = min(FALLBACK_LENGTH, gamma)
        if not self._in_fallback:
            what = "no confidences" if confidences is None else "NaN or inf in the confidences"
            logger.warning("%s: %s; verifying a static %d tokens per request", self.name, what, length)
            self._in_fallback = True
        return torch.full((num_requests,), length, dtype=torch.int64)

    @abstractmethod
    def _lengths(self, confidences: np.ndarray) -> torch.Tensor:
        """Lengths [R] (CPU int64) for finite float64 confidences [R, gamma], R and gamma >= 1."""
