"""The live acceptance scale: how far the drafter's predicted survival over- or under-states what
verification accepts, learned per draft position from the engine's step statistics."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dspark.engine.outputs import StepStats
from dspark.engine.policy_spec import PolicySettings


class AcceptanceScale:
    """Per position k: accepted draft tokens over predicted survival, summed with forgetting per
    request round that verified, plus a prior at ratio 1: over-confident live survival verifies too much."""

    def __init__(self, settings: PolicySettings = PolicySettings()) -> None:
        self.settings = settings
        self._predicted, self._accepted = np.zeros(0), np.zeros(0)

    def observe(self, predicted: Sequence[float], accepted: Sequence[int], rounds: int = 1) -> None:
        """One drafted step's survival and accepted tokens per position; `rounds` requests verified."""
        if not predicted or not all(math.isfinite(p) and p >= 0 for p in predicted):
            return
        forget = self.settings.acceptance_decay ** max(rounds, 1)
        self._predicted = _grown(self._predicted, len(predicted)) * forget
        self._accepted = _grown(self._accepted, len(predicted)) * forget
        self._predicted[: len(predicted)] += predicted
        counts = np.asarray(list(accepted)[: len(predicted)], dtype=np.float64)
        self._accepted[: counts.size] += counts

    def update(self, stats: StepStats) -> None:
        if stats.drafted:
            rounds = sum(budget > 0 for budget in stats.verify_budgets)
            self.observe(stats.predicted_per_position, stats.accepted_per_position, rounds)

    def factors(self, width: int) -> np.ndarray:
        """[width] observed / predicted survival per position (1 where nothing was verified)."""
        pred, acc = _grown(self._predicted, width)[:width], _grown(self._accepted, width)[:width]
        prior = self.settings.acceptance_prior_tokens
        return (acc + prior) / (pred + prior)

    def apply(self, confidences: np.ndarray) -> np.ndarray:
        """Confidences [R, w] whose survival is the input's times `factors`, in [0, 1] and non-increasing."""
        survival = np.cumprod(confidences, axis=1) * self.factors(confidences.shape[1])
        survival = np.minimum.accumulate(np.clip(survival, 0.0, 1.0), axis=1)
        before = np.concatenate([np.ones((survival.shape[0], 1)), survival[:, :-1]], axis=1)
        return np.where(before > 0, survival / np.maximum(before, 1e-300), 0.0)


def _grown(values: np.ndarray, width: int) -> np.ndarray:
    return values if values.size >= width else np.pad(values, (0, width - values.size))
