"""Synthetic speculative rounds with known per-position acceptance probabilities."""

from __future__ import annotations

import numpy as np
from dspark.calibration.rounds import RoundLog


def overconfident_rounds(
    n: int = 6000, gamma: int = 7, scale: float = 3.0, seed: int = 0, shift: float = 0.0
) -> RoundLog:
    """Position k is accepted (given 1..k-1 were) with probability sigmoid(z_k); the drafter reports
    logits `scale * z_k + shift` (scale > 1 or shift > 0: over-confident). Every block is fully
    verified."""
    rng = np.random.default_rng(seed)
    z = rng.normal(1.2, 1.5, size=(n, gamma)) - 0.15 * np.arange(gamma)[None, :]
    accept = rng.random((n, gamma)) < 1 / (1 + np.exp(-z))
    accepted = np.where(accept.all(axis=1), gamma, np.argmin(accept, axis=1))
    domains = np.array(["math", "code", "chat"])[rng.integers(0, 3, n)]
    requests = np.array([f"{d}/{i // 40}" for i, d in enumerate(domains)])
    return RoundLog(scale * z + shift, accepted, np.full(n, gamma), domains, requests)
