"""How far the drafter's confidences are off on live traffic: observed / predicted acceptance."""

from __future__ import annotations

import math

import torch


class AcceptanceScale:
    """Accepted draft tokens over the tokens the confidences predicted (sum of survival over the
    verified positions), both summed with exponential forgetting over drafted steps, with a
    prior of `prior_tokens` at ratio 1. Calibration is fitted offline on one prompt mix; live
    traffic (other prompts, other lengths, text past an ignored EOS) can differ, and a scheduler
    that trusts over-confident survival verifies too much and drafts when it does not pay.

    `apply` multiplies every survival probability by the factor (the first position's confidence,
    clamped to [0, 1]); it depends on earlier steps only, so schedules stay lossless.
    """

    def __init__(self, decay: float = 0.98, prior_tokens: float = 5.0) -> None:
        self.decay = decay
        self.prior_tokens = prior_tokens
        self._predicted = 0.0
        self._accepted = 0.0

    def observe(self, predicted: float | None, accepted: int) -> None:
        if predicted is None or not math.isfinite(predicted) or predicted < 0:
            return
        self._predicted = self.decay * self._predicted + predicted
        self._accepted = self.decay * self._accepted + accepted

    @property
    def factor(self) -> float:
        return (self._accepted + self.prior_tokens) / (self._predicted + self.prior_tokens)

    def apply(self, confidences: torch.Tensor) -> torch.Tensor:
        scaled = confidences.clone()
        scaled[:, :1] = (scaled[:, :1] * self.factor).clamp(0.0, 1.0)
        return scaled
