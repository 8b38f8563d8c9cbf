"""How far the drafter's confidences are off on live traffic: observed / predicted acceptance,
per block position."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class AcceptanceScale:
    """Per position k: draft tokens accepted at k over the survival the confidences predicted at
    k (over the verified positions), both summed with exponential forgetting, with a prior of
    `prior_tokens` at ratio 1. Forgetting is per request round that verified something
    (`decay` each), not per step: at one request a per-step window of 50 steps held about five
    predicted tokens at position 2, so the prior kept that factor near 1 whatever was accepted,
    while 64 requests fill the same window in one step.

    Calibration is fitted offline on one prompt mix and has few positive rounds past the first
    positions; live traffic (other prompts, other lengths, text past an ignored EOS) can differ,
    and a scheduler that trusts over-confident survival verifies too much, while under-confident
    later positions leave cheap tokens unverified (at one CPU user the confidences predicted half
    of what positions 2-3 returned).

    `apply` multiplies each survival probability by its position's factor (kept in [0, 1] and
    non-increasing along the block) and returns the matching conditional confidences; it depends
    on earlier steps only, so schedules stay lossless.
    """

    def __init__(self, decay: float = 0.999, prior_tokens: float = 5.0) -> None:
        self.decay = decay
        self.prior_tokens = prior_tokens
        self._predicted = torch.zeros(0, dtype=torch.float64)
        self._accepted = torch.zeros(0, dtype=torch.float64)

    def observe(self, predicted: Sequence[float], accepted: Sequence[int], rounds: int = 1) -> None:
        """Predicted survival and accepted tokens per position of one drafted step, in which
        `rounds` requests verified draft tokens."""
        if not predicted or not all(math.isfinite(p) and p >= 0 for p in predicted):
            return
        width = max(len(predicted), self._predicted.numel())
        forget = self.decay ** max(rounds, 1)
        self._predicted = _grown(self._predicted, width) * forget
        self._accepted = _grown(self._accepted, width) * forget
        self._predicted[: len(predicted)] += torch.tensor(predicted, dtype=torch.float64)
        counts = torch.tensor(list(accepted)[: len(predicted)], dtype=torch.float64)
        self._accepted[: counts.numel()] += counts

    def factors(self, width: int) -> torch.Tensor:
        """[width] observed / predicted survival per position (1 where nothing was verified)."""
        pred, acc = _grown(self._predicted, width)[:width], _grown(self._accepted, width)[:width]
        return (acc + self.prior_tokens) / (pred + self.prior_tokens)

    @property
    def factor(self) -> float:
        """The first position's factor."""
        return float(self.factors(1)[0])

    def apply(self, confidences: torch.Tensor) -> torch.Tensor:
        survival = confidences.cumprod(dim=1) * self.factors(confidences.shape[1])
        survival = survival.clamp(0.0, 1.0).cummin(dim=1).values
        before = torch.cat([survival.new_ones(survival.shape[0], 1), survival[:, :-1]], dim=1)
        return torch.where(before > 0, survival / before.clamp_min(1e-300), torch.zeros_like(survival))


def _grown(values: torch.Tensor, width: int) -> torch.Tensor:
    """`values` zero-extended to at least `width` (itself when already that long)."""
    return values if values.numel() >= width else torch.nn.functional.pad(values, (0, width - values.numel()))
