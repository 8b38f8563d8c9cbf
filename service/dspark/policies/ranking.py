"""Verify lengths from confidences: DSpark's Algorithm 1 and its relatives, as array ops.

Candidates are the survival probabilities a[r, j] = prod_{i<=j} c[r, i] (`dspark.engine.survival`),
ranked by a stable descending sort of the row-major flattening: a[r, j] >= a[r, j+1] and ties keep
(r, j) ahead of (r, j+1), so every ranked prefix is a set of per-request prefixes and a request's
length is how many of its candidates were taken. Only a > 0 candidates exist (Algorithm 1's E).
Lengths come back as a CPU int64 tensor: the engine lays out the batch on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from dspark.engine.survival import survival_probabilities

SpsFn = Callable[[np.ndarray], np.ndarray]
"""Steps per second for float64 batch sizes (NumPy in, NumPy out)."""


def ranked_candidates(confidences: torch.Tensor | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidates best first: (survival values [M], request index [M])."""
    survival = survival_probabilities(confidences)
    values = survival.ravel()
    order = np.argsort(-values, kind="stable")
    return values[order], order // survival.shape[1]


def _ranked_lengths(
    confidences: torch.Tensor | np.ndarray, taken: Callable[[np.ndarray, int], int]
) -> torch.Tensor:
    """Lengths when the first `taken(values, R)` ranked candidates are verified."""
    num_requests, gamma = confidences.shape
    if num_requests == 0 or gamma == 0:
        return torch.zeros(num_requests, dtype=torch.int64)
    values, rows = ranked_candidates(confidences)
    count = taken(values, num_requests)
    return torch.from_numpy(np.bincount(rows[:count], minlength=num_requests).astype(np.int64))


def expected_throughputs(
    values: np.ndarray, num_requests: int, sps_fn: SpsFn, weight: float = 1.0
) -> np.ndarray:
    """Theta after admitting 0, 1, ..., M ranked candidates; -inf past the last a > 0. Each
    candidate counts `weight` times (rows standing for more or fewer requests than they are)."""
    tau = num_requests + weight * np.concatenate(([0.0], np.cumsum(values)))
    theta = tau * np.asarray(sps_fn(num_requests + weight * np.arange(values.size + 1.0)), dtype=np.float64)
    theta[1:][values <= 0] = -np.inf
    return theta


def early_stop(theta: np.ndarray) -> int:
    """How many candidates Algorithm 1 admits: greedy's best is always the previous Theta, so
    "break at the first Theta <= best" is "count the leading strict increases"."""
    rising = theta[1:] > theta[:-1]
    return int(rising.size if rising.all() else rising.argmin())


def prefix_greedy_lengths(confidences: torch.Tensor | np.ndarray, sps_fn: SpsFn) -> torch.Tensor:
    """Algorithm 1: admit ranked candidates while expected throughput Theta strictly rises. The
    early break makes it causal: candidate n's admission depends only on candidates ranked above
    it, never on a later a[r, j+1] that the sampled x[r, j] shaped (paper Appendix A)."""
    return _ranked_lengths(confidences, lambda v, r: early_stop(expected_throughputs(v, r, sps_fn)))


def global_argmax_lengths(confidences: torch.Tensor | np.ndarray, sps_fn: SpsFn) -> torch.Tensor:
    """Admit the ranked prefix with the highest Theta, no early break (first maximum wins). NOT
    lossless on the current step's confidences (x[r, j] votes on its own admission through
    a[r, j+1]); only safe on earlier steps' confidences, as `AsyncSplit` uses it."""
    return _ranked_lengths(confidences, lambda v, r: int(expected_throughputs(v, r, sps_fn).argmax()))


def topk_survival(confidences: torch.Tensor | np.ndarray, k: int) -> torch.Tensor:
    """Verify the `k` draft tokens with the highest survival probability (fewer if fewer have a > 0)."""
    return _ranked_lengths(confidences, lambda v, r: max(0, min(int(k), int((v > 0).sum()))))
