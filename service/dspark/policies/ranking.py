"""Verify lengths from confidences: DSpark's Algorithm 1 and its relatives, as array ops.

All schedulers take confidences c [R, gamma] (c[r, k] = P(draft k+1 accepted | all before it
accepted)) and return lengths [R] as a CPU int64 tensor. Candidates are the survival
probabilities a[r, j] = prod_{i<=j} c[r, i], ranked by a stable descending sort of the
row-major flattening: a[r, j] >= a[r, j+1] and, on ties, (r, j) stays ahead of (r, j+1), so
every ranked prefix of candidates is a set of per-request prefixes and a request's length is
simply how many of its candidates were taken. Only a > 0 candidates exist (Algorithm 1's E).

The arithmetic runs in NumPy on the host (see `dspark.engine.survival`); the engine needs the
lengths on the host to lay out the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from dspark.engine.survival import host_array, survival_probabilities

SpsFn = Callable[[np.ndarray], np.ndarray]
"""Steps per second for float64 batch sizes (NumPy in, NumPy out)."""


def ranked_candidates(confidences: torch.Tensor | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidates best first: (survival values [M], request index [M])."""
    survival = survival_probabilities(confidences)
    values = survival.ravel()
    order = np.argsort(-values, kind="stable")
    return values[order], order // survival.shape[1]


def _lengths(rows: np.ndarray, taken: int, num_requests: int) -> torch.Tensor:
    """Lengths when the first `taken` ranked candidates are verified."""
    return torch.from_numpy(np.bincount(rows[:taken], minlength=num_requests).astype(np.int64))


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


def _empty(confidences: torch.Tensor | np.ndarray) -> torch.Tensor | None:
    num_requests, gamma = confidences.shape
    return torch.zeros(num_requests, dtype=torch.int64) if num_requests == 0 or gamma == 0 else None


def prefix_greedy_lengths(confidences: torch.Tensor | np.ndarray, sps_fn: SpsFn) -> torch.Tensor:
    """Algorithm 1: admit ranked candidates while expected throughput Theta strictly rises.

    The early break makes it causal: whether candidate n is admitted depends only on the
    candidates ranked above it, never on a later a[r, j+1] that the sampled x[r, j] shaped
    (paper Appendix A).
    """
    if (empty := _empty(confidences)) is not None:
        return empty
    values, rows = ranked_candidates(confidences)
    taken = early_stop(expected_throughputs(values, confidences.shape[0], sps_fn))
    return _lengths(rows, taken, confidences.shape[0])


def global_argmax_lengths(confidences: torch.Tensor | np.ndarray, sps_fn: SpsFn) -> torch.Tensor:
    """Admit the ranked prefix with the highest Theta, with no early break (first maximum wins).

    NOT lossless on the current step's confidences (it lets x[r, j] vote on its own admission
    through a[r, j+1]); only safe on confidences from earlier steps, as `DSparkAsyncPolicy` does.
    """
    if (empty := _empty(confidences)) is not None:
        return empty
    values, rows = ranked_candidates(confidences)
    taken = int(expected_throughputs(values, confidences.shape[0], sps_fn).argmax())
    return _lengths(rows, taken, confidences.shape[0])


def topk_survival(confidences: torch.Tensor | np.ndarray, k: int) -> torch.Tensor:
    """Verify the `k` draft tokens with the highest survival probability (fewer if fewer have a > 0)."""
    if (empty := _empty(confidences)) is not None:
        return empty
    values, rows = ranked_candidates(confidences)
    taken = max(0, min(int(k), int((values > 0).sum())))
    return _lengths(rows, taken, confidences.shape[0])


def leading_at_least(confidences: torch.Tensor | np.ndarray, threshold: float) -> torch.Tensor:
    """Per request, how many leading positions have c >= threshold (SpecDec++-style stop)."""
    leading = np.cumprod(host_array(confidences) >= threshold, axis=1).sum(axis=1)
    return torch.from_numpy(leading.astype(np.int64))
