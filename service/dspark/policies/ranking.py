"""Verify lengths from confidences: DSpark's Algorithm 1 and its relatives, as array ops. A stable
descending sort of the survival probabilities' row-major flattening keeps (r, j) ahead of (r, j+1)
on ties, so every ranked prefix is a set of per-request prefixes and a request's length is how
many of its candidates were taken; only a > 0 candidates exist (Algorithm 1's E)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from dspark.engine.verify_policy import survival_probabilities

SpsFn = Callable[[np.ndarray], np.ndarray]  # steps per second for float64 batch sizes
Confs = torch.Tensor | np.ndarray  # [R, gamma] confidences


def ranked_candidates(confidences: Confs) -> tuple[np.ndarray, np.ndarray]:
    """Candidates best first: (survival values [M], request index [M])."""
    survival = survival_probabilities(confidences)
    order = np.argsort(-survival.ravel(), kind="stable")
    return survival.ravel()[order], order // max(survival.shape[1], 1)


def _ranked_lengths(confidences: Confs, taken: Callable[[np.ndarray, int], int]) -> torch.Tensor:
    """Lengths when the first `taken(values, R)` ranked candidates are verified."""
    values, rows = ranked_candidates(confidences)
    count = taken(values, confidences.shape[0])
    return torch.from_numpy(np.bincount(rows[:count], minlength=confidences.shape[0]).astype(np.int64))


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


def prefix_greedy_lengths(confidences: Confs, sps_fn: SpsFn) -> torch.Tensor:
    """Algorithm 1: admit ranked candidates while Theta strictly rises. The early break keeps it causal:
    a candidate's admission never depends on an a[r, j+1] that the sampled x[r, j] shaped (Appendix A)."""
    return _ranked_lengths(confidences, lambda v, r: early_stop(expected_throughputs(v, r, sps_fn)))


def global_argmax_lengths(confidences: Confs, sps_fn: SpsFn) -> torch.Tensor:
    """The ranked prefix with the highest Theta (first maximum wins), no early break: lossless only on
    earlier steps' confidences, as `AsyncSplit` uses it (on this step's, x[r, j] votes via a[r, j+1])."""
    return _ranked_lengths(confidences, lambda v, r: int(expected_throughputs(v, r, sps_fn).argmax()))


def topk_survival(confidences: Confs, k: int) -> torch.Tensor:
    """Verify the `k` draft tokens with the highest survival probability (fewer if fewer have a > 0)."""
    return _ranked_lengths(confidences, lambda v, r: max(0, min(int(k), int((v > 0).sum()))))
