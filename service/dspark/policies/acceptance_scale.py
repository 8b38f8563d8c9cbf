"""How far the drafter's confidences are off on live traffic: observed / predicted acceptance per
block position, applied to later steps' survival probabilities (so schedules stay lossless)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dspark.engine.outputs import StepStats
from dspark.engine.policy_spec import PolicySettings


class AcceptanceScale:
    """Per position k: accepted draft tokens over the survival the confidences predicted, summed
    with forgetting per request round that verified (one request and 64 forget at the same pace),
    plus a prior at ratio 1. Calibration is fitted offline; trusting over-confident live survival
    verifies too much."""

    def __init__(self, settings: PolicySettings = PolicySettings()) -> None:
        self.settings = settings
        self._predicted = np.zeros(0)
        self._accepted = np.zeros(0)

    def observe(self, predicted: Sequence[float], accepted: Sequence[int], rounds: int = 1) -> None:
        """Predicted survival and accepted tokens per position of one drafted step, in which
        `rounds` requests verified draft tokens."""
        if not predicted or not all(math.isfinite(p) and p >= 0 for p in predicted):
            return
        forget = self.settings.acceptance_decay ** max(rounds, 1)
        self._predicted = _grown(self._predicted, len(predicted)) * forget
        self._accepted = _grown(self._accepted, len(predicted)) * forget
        self._predicted[: len(predicted)] += predicted
        counts = np.asarray(list(accepted)[: len(predicted)], dtype=np.float64)
        self._accepted[: counts.size] += counts

    def update(self, stats: StepStats) -> None:
        """Learn from a drafted step's predicted and accepted tokens per position."""
        if stats.drafted:
            rounds = sum(budget > 0 for budget in stats.verify_budgets)
            self.observe(stats.predicted_per_position, stats.accepted_per_position, rounds)

    def factors(self, width: int) -> np.ndarray:
        """[width] observed / predicted survival per position (1 where nothing was verified)."""
        pred, acc = _grown(self._predicted, width)[:width], _grown(self._accepted, width)[:width]
        prior = self.settings.acceptance_prior_tokens
        return (acc + prior) / (pred + prior)

    def apply(self, confidences: np.ndarray) -> np.ndarray:
        """Conditional confidences [R, w] whose survival is the input's times `factors`, kept in
        [0, 1] and non-increasing along the block (float64 NumPy, like the input)."""
        survival = np.cumprod(confidences, axis=1) * self.factors(confidences.shape[1])
        survival = np.minimum.accumulate(np.clip(survival, 0.0, 1.0), axis=1)
        before = np.ones_like(survival)
        before[:, 1:] = survival[:, :-1]
        return np.where(before > 0, survival / np.maximum(before, 1e-300), 0.0)


def _grown(values: np.ndarray, width: int) -> np.ndarray:
    """`values` zero-extended to at least `width` (itself when already that long)."""
    return values if values.size >= width else np.pad(values, (0, width - values.size))
