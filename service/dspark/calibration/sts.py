"""Sequential Temperature Scaling: one temperature per block position, fitted left to right.

For k = 1..gamma, T_k is the grid point minimising the ECE of a_k = prod_{i<=k} sigmoid(z_i / T_i)
against observed prefix survival, with T_1..T_{k-1} already fixed. A positive temperature keeps
the order of every position's confidences c_k (the cumulative a_k may reorder slightly, since its
factors are rescaled differently, so AUC is reported before and after).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark.calibration.metrics import DEFAULT_BINS, expected_calibration_error, roc_auc
from dspark.calibration.rounds import RoundLog, _sigmoid, cumulative_confidence

# Geometric grid from 0.05 to 20 (ratio ~1.025 between neighbours), with 1.0 on it.
TEMPERATURE_GRID = np.unique(np.r_[np.geomspace(0.05, 20.0, 241), 1.0])
ECE_TOLERANCE = 1e-4


@dataclass
class PositionReport:
    position: int  # 1-based
    rounds: int  # rounds where survival of 1..k was observed
    survival_rate: float
    temperature: float
    ece_before: float
    ece_after: float
    auc_before: float  # ROC-AUC of a_k for prefix survival, raw confidences
    auc_after: float  # the same with the temperatures (products of rescaled factors may reorder)

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def fit_sts(
    rounds: RoundLog, grid: np.ndarray = TEMPERATURE_GRID, bins: int = DEFAULT_BINS
) -> tuple[list[float], list[PositionReport]]:
    """Per-position temperatures and, per position, ECE before/after and AUC on these rounds."""
    if not rounds.has_confidences:
        raise ValueError("these rounds have no confidence logits (the drafter has no confidence head)")
    survived, observed = rounds.survival()
    logits = rounds.conf_logits
    temperatures: list[float] = []
    prefix = np.ones(len(rounds))  # prod_{i<k} c_i with the fitted temperatures
    for k in range(rounds.gamma):
        seen = observed[:, k]
        if not seen.any():
            raise ValueError(f"no round observed position {k + 1}; record more rounds")
        outcome = survived[seen, k]
        # [grid, n]: a_k for every candidate T_k at once.
        candidates = prefix[seen][None, :] * _sigmoid(logits[seen, k][None, :] / grid[:, None])
        errors = np.array([expected_calibration_error(a, outcome, bins) for a in candidates])
        # Move away from T = 1 only as far as it measurably helps: among the temperatures within
        # ECE_TOLERANCE of the best, take the one closest to 1 (positions that almost never survive
        # otherwise drift to the grid's end for a negligible gain).
        near = np.flatnonzero(errors <= errors.min() + ECE_TOLERANCE)
        best = int(near[np.argmin(np.abs(np.log(grid[near])))])
        temperatures.append(float(grid[best]))
        prefix = prefix * _sigmoid(logits[:, k] / grid[best])
    return temperatures, evaluate(rounds, temperatures, bins)


def evaluate(
    rounds: RoundLog, temperatures: list[float] | None, bins: int = DEFAULT_BINS
) -> list[PositionReport]:
    """ECE of a_k against prefix survival without and with `temperatures`, and AUC, per position."""
    survived, observed = rounds.survival()
    raw = cumulative_confidence(rounds.conf_logits)
    calibrated = cumulative_confidence(rounds.conf_logits, temperatures)
    reports = []
    for k in range(rounds.gamma):
        seen = observed[:, k]
        outcome = survived[seen, k]
        reports.append(
            PositionReport(
                position=k + 1,
                rounds=int(seen.sum()),
                survival_rate=float(outcome.mean()) if seen.any() else float("nan"),
                temperature=float(temperatures[k])
                if temperatures is not None and k < len(temperatures)
                else 1.0,
                ece_before=expected_calibration_error(raw[seen, k], outcome, bins),
                ece_after=expected_calibration_error(calibrated[seen, k], outcome, bins),
                auc_before=roc_auc(raw[seen, k], outcome),
                auc_after=roc_auc(calibrated[seen, k], outcome),
            )
        )
    return reports
