"""How far the drafter's confidences are off on live traffic: observed / predicted acceptance,
per block position."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dspark.engine.outputs import StepStats


class AcceptanceScale:
    """Per position k: draft tokens accepted at k over the survival the confidences predicted at
    k, both summed with exponential forgetting (`decay` per request round that verified something,
    so one request and 64 forget at the same pace), with a prior of `prior_tokens` at ratio 1.

    Calibration is fitted offline on one prompt mix; live traffic can differ, and a scheduler
    that trusts over-confident survival verifies too much. `apply` multiplies each survival
    probability by its position's factor (kept in [0, 1], non-increasing along the block) and
    returns the matching conditional confidences; it depends on earlier steps only, so schedules
    stay lossless.
    """

    def __init__(self, decay: float = 0.999, prior_tokens: float = 5.0) -> None:
        self.decay = decay
        self.prior_tokens = prior_tokens
        self._predicted = np.zeros(0)
        self._accepted = np.zeros(0)

    def observe(self, predicted: Sequence[float], accepted: Sequence[int], rounds: int = 1) -> None:
        """Predicted survival and accepted tokens per position of one drafted step, in which
        `rounds` requests verified draft tokens."""
        if not predicted or not all(math.isfinite(p) and p >= 0 for p in predicted):
            return
        width = max(len(predicted), self._predicted.size)
        forget = self.decay ** max(rounds, 1)
        self._predicted = _grown(self._predicted, width) * forget
        self._accepted = _grown(self._accepted, width) * forget
        self._predicted[: len(predicted)] += predicted
        counts = np.asarray(list(accepted)[: len(predicted)], dtype=np.float64)
        self._accepted[: counts.size] += counts

    def update(self, stats: StepStats) -> None:
        """Learn from a drafted step: predicted survival and accepted tokens per position."""
        if stats.drafted:
            rounds = sum(1 for budget in stats.verify_budgets if budget > 0)
            self.observe(stats.predicted_per_position, stats.accepted_per_position, rounds)

    def factors(self, width: int) -> np.ndarray:
        """[width] observed / predicted survival per position (1 where nothing was verified)."""
        pred, acc = _grown(self._predicted, width)[:width], _grown(self._accepted, width)[:width]
        return (acc + self.prior_tokens) / (pred + self.prior_tokens)

    def apply(self, confidences: np.ndarray) -> np.ndarray:
        """Rescaled conditional confidences [R, w] (float64 NumPy, like the input)."""
        survival = np.cumprod(confidences, axis=1) * self.factors(confidences.shape[1])
        survival = np.minimum.accumulate(np.clip(survival, 0.0, 1.0), axis=1)
        before = np.ones_like(survival)
        before[:, 1:] = survival[:, :-1]
        return np.where(before > 0, survival / np.maximum(before, 1e-300), 0.0)


def _grown(values: np.ndarray, width: int) -> np.ndarray:
    """`values` zero-extended to at least `width` (itself when already that long)."""
    return values if values.size >= width else np.pad(values, (0, width - values.size))
