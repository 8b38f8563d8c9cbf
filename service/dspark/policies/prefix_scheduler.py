"""Verify lengths from confidences: DSpark's Algorithm 1 and its relatives, as tensor ops.

All functions take confidences c [R, gamma] (c[r, k] = P(draft k+1 accepted | all before it
accepted)) and return lengths [R] int64 on the same device. Candidates are the survival
probabilities a[r, j] = prod_{i<=j} c[r, i], ranked by a stable descending sort of the
row-major flattening: a[r, j] >= a[r, j+1] and, on ties, (r, j) stays ahead of (r, j+1), so
every ranked prefix of candidates is a set of per-request prefixes and a request's length is
simply how many of its candidates were taken. Only a > 0 candidates exist (Algorithm 1's E).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SpsFn = Callable[[torch.Tensor], torch.Tensor]


def survival_probabilities(confidences: torch.Tensor) -> torch.Tensor:
    """a[r, j] = prod_{i<=j} c[r, i] in float64; confidences are clamped into [0, 1] first."""
    return confidences.to(torch.float64).clamp(0.0, 1.0).cumprod(dim=1)


def ranked_candidates(confidences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates best first: (survival values [M], request index [M])."""
    gamma = confidences.shape[1]
    values, order = torch.sort(survival_probabilities(confidences).flatten(), descending=True, stable=True)
    return values, torch.div(order, gamma, rounding_mode="floor")


def _lengths(rows: torch.Tensor, taken: torch.Tensor, num_requests: int) -> torch.Tensor:
    """Lengths when the first `taken` ranked candidates are verified."""
    take = torch.arange(rows.numel(), device=rows.device) < taken
    return torch.zeros(num_requests, dtype=torch.int64, device=rows.device).scatter_add_(0, rows, take.long())


def expected_throughputs(
    values: torch.Tensor, num_requests: int, sps_fn: SpsFn, weight: float = 1.0
) -> torch.Tensor:
    """Theta after admitting 0, 1, ..., M ranked candidates; -inf past the last a > 0. Each
    candidate counts `weight` times (rows standing for more or fewer requests than they are)."""
    n = torch.arange(values.numel() + 1, device=values.device)
    tau = num_requests + weight * torch.cat([values.new_zeros(1), values.cumsum(0)])
    theta = tau * sps_fn(num_requests + weight * n).to(device=values.device, dtype=torch.float64)
    theta[1:] = theta[1:].masked_fill(values <= 0, float("-inf"))
    return theta


def early_stop(theta: torch.Tensor) -> torch.Tensor:
    """How many candidates Algorithm 1 admits: greedy's best is always the previous Theta, so
    "break at the first Theta <= best" is "count the leading strict increases"."""
    return (theta[1:] > theta[:-1]).long().cumprod(0).sum()


def schedule_prefix_greedy(confidences: torch.Tensor, sps_fn: SpsFn) -> torch.Tensor:
    """Algorithm 1: admit ranked candidates while expected throughput Theta strictly rises.

    The early break makes it causal: whether candidate n is admitted depends only on the
    candidates ranked above it, never on a later a[r, j+1] that the sampled x[r, j] shaped
    (paper Appendix A).
    """
    num_requests, gamma = confidences.shape
    if num_requests == 0 or gamma == 0:
        return torch.zeros(num_requests, dtype=torch.int64, device=confidences.device)
    values, rows = ranked_candidates(confidences)
    taken = early_stop(expected_throughputs(values, num_requests, sps_fn))
    return _lengths(rows, taken, num_requests)


def schedule_global_argmax(confidences: torch.Tensor, sps_fn: SpsFn) -> torch.Tensor:
    """Admit the ranked prefix with the highest Theta, with no early break (first maximum wins).

    NOT lossless on the current step's confidences (it lets x[r, j] vote on its own admission
    through a[r, j+1]); only safe on confidences from earlier steps, as `DSparkAsyncPolicy` does.
    """
    num_requests, gamma = confidences.shape
    if num_requests == 0 or gamma == 0:
        return torch.zeros(num_requests, dtype=torch.int64, device=confidences.device)
    values, rows = ranked_candidates(confidences)
    taken = expected_throughputs(values, num_requests, sps_fn).argmax()
    return _lengths(rows, taken, num_requests)


def topk_survival(confidences: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """Verify the `k` draft tokens with the highest survival probability (fewer if fewer have a > 0)."""
    num_requests, gamma = confidences.shape
    if num_requests == 0 or gamma == 0:
        return torch.zeros(num_requests, dtype=torch.int64, device=confidences.device)
    values, rows = ranked_candidates(confidences)
    taken = (values > 0).sum().clamp(min=0, max=k)
    return _lengths(rows, taken, num_requests)


def leading_at_least(confidences: torch.Tensor, threshold: float) -> torch.Tensor:
    """Per request, how many leading positions have c >= threshold (SpecDec++-style stop)."""
    return (confidences >= threshold).long().cumprod(dim=1).sum(dim=1)
