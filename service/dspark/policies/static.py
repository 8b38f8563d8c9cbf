"""Fixed verify lengths: no speculation, a static length, or the full block."""

from __future__ import annotations

import torch

from dspark.engine.policy_spec import PolicyName
from dspark.engine.verify_policy import Confidences, VerifyPolicy


class StaticPolicy(VerifyPolicy):
    """Verify min(length, gamma) draft tokens for every request (length None = full block)."""

    def __init__(self, length: int | None) -> None:
        if length is not None and length < 0:
            raise ValueError(f"static verify length must be >= 0, got {length}")
        self.length = length
        self.name = (
            PolicyName.FULL
            if length is None
            else PolicyName.NONE
            if length == 0
            else f"{PolicyName.STATIC}:{length}"
        )

    def max_length(self, gamma: int, num_requests: int = 1) -> int:
        return gamma if self.length is None else min(self.length, gamma)

    def verify_lengths(self, confidences: Confidences, gamma: int, num_requests: int) -> torch.Tensor:
        return torch.full((num_requests,), self.max_length(gamma), dtype=torch.int64)
