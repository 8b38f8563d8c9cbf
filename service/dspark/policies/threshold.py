"""SpecDec++-style baseline: verify up to the first position whose confidence falls below x."""

from __future__ import annotations

import math

import numpy as np
import torch

from dspark.policies.confidence import ConfidencePolicy
from dspark.policies.ranking import leading_at_least


class ThresholdPolicy(ConfidencePolicy):
    """l_r = number of leading positions with c_{r,k} >= x (a static, load-blind threshold)."""

    def __init__(self, threshold: float) -> None:
        super().__init__()
        if not (math.isfinite(threshold) and 0 < threshold < 1):
            raise ValueError(f"confidence threshold must be strictly between 0 and 1, got {threshold}")
        self.threshold = threshold
        self.name = f"threshold:{threshold:g}"

    def _lengths(self, confidences: np.ndarray) -> torch.Tensor:
        return leading_at_least(confidences, self.threshold)
