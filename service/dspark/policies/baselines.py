"""The baselines DSpark is compared with: fixed verify lengths, and a confidence threshold."""

from __future__ import annotations

import numpy as np
import torch

from dspark.engine.policy_spec import PolicyName
from dspark.engine.verify_policy import ConfidenceGuard, Confidences, VerifyChoice, VerifyPolicy


class StaticPolicy(VerifyPolicy):
    """Verify min(length, gamma) draft tokens for every request (length None = full block)."""

    def __init__(self, length: int | None) -> None:  # length >= 0, checked by `parse_policy`
        self.length = length
        self.name = {None: PolicyName.FULL, 0: PolicyName.NONE}.get(length, f"{PolicyName.STATIC}:{length}")

    def max_length(self, gamma: int, num_requests: int = 1) -> int:
        return gamma if self.length is None else min(self.length, gamma)

    def choose(self, confidences: Confidences, gamma: int, num_requests: int) -> VerifyChoice:
        return VerifyChoice(torch.full((num_requests,), self.max_length(gamma), dtype=torch.int64))


class ThresholdPolicy(VerifyPolicy):
    """SpecDec++-style: l_r = number of leading positions with c_{r,k} >= x (static, load-blind)."""

    def __init__(self, threshold: float) -> None:  # 0 < threshold < 1, checked by `parse_policy`
        self.threshold = threshold
        self.name = f"{PolicyName.THRESHOLD}:{threshold:g}"
        self.guard = ConfidenceGuard(self.name)

    @property
    def fallbacks(self) -> int:
        return self.guard.fallbacks

    def choose(self, confidences: Confidences, gamma: int, num_requests: int) -> VerifyChoice:
        return self.guard.choose(confidences, gamma, num_requests, self._lengths)

    def _lengths(self, confidences: np.ndarray) -> torch.Tensor:
        leading = np.cumprod(confidences >= self.threshold, axis=1).sum(axis=1)
        return torch.from_numpy(leading.astype(np.int64))
