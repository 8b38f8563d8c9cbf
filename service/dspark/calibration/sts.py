"""Sequential Temperature Scaling: one temperature per block position, fitted left to right.

For k = 1..gamma, T_k is the grid point minimising the ECE of a_k = prod_{i<=k} sigmoid(z_i / T_i)
against observed prefix survival, with T_1..T_{k-1} already fixed. A positive temperature keeps
the order of every position's confidences c_k (the cumulative a_k may reorder slightly, since its
factors are rescaled differently, so AUC is reported before and after).

With `offsets`, each position also shifts its logit, c_k = sigmoid(z_k / T_k + b_k) (still order
preserving; Platt scaling of the cumulative a_k, fitted left to right the same way): a temperature
only stretches confidences about 0.5, and a head that is over-confident on one side of it needs
the shift. (T_k, b_k) then minimise the log loss of a_k, a proper score: with an offset, the ECE
itself is minimised by squashing every confidence to the base rate, which keeps no information
for the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dspark.calibration.metrics import DEFAULT_BINS, expected_calibration_error, roc_auc
from dspark.calibration.rounds import RoundLog, _sigmoid, cumulative_confidence

# Geometric grid from 0.05 to 20 (ratio ~1.025 between neighbours), with 1.0 on it.
TEMPERATURE_GRID = np.unique(np.r_[np.geomspace(0.05, 20.0, 241), 1.0])
OFFSET_GRID = np.round(np.linspace(-2.0, 2.0, 81), 2)  # logit shifts, steps of 0.05, 0 included
SCORE_TOLERANCE = 1e-4


@dataclass
class PositionReport:
    position: int  # 1-based
    rounds: int  # rounds where survival of 1..k was observed
    survival_rate: float
    temperature: float
    offset: float
    ece_before: float
    ece_after: float
    auc_before: float  # ROC-AUC of a_k for prefix survival, raw confidences
    auc_after: float  # the same with the temperatures (products of rescaled factors may reorder)

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def fit_sts(
    rounds: RoundLog,
    grid: np.ndarray = TEMPERATURE_GRID,
    bins: int = DEFAULT_BINS,
    offsets: bool = False,
) -> tuple[list[float], list[PositionReport]]:
    """Per-position temperatures (and, with `offsets`, logit offsets: see the reports) and, per
    position, ECE before/after and AUC on these rounds."""
    if not rounds.has_confidences:
        raise ValueError("these rounds have no confidence logits (the drafter has no confidence head)")
    survived, observed = rounds.survival()
    logits = rounds.conf_logits
    shifts = OFFSET_GRID if offsets else np.zeros(1)
    temperatures: list[float] = []
    biases: list[float] = []
    prefix = np.ones(len(rounds))  # prod_{i<k} c_i with the fitted temperatures
    for k in range(rounds.gamma):
        seen = observed[:, k]
        if not seen.any():
            raise ValueError(f"no round observed position {k + 1}; record more rounds")
        outcome = survived[seen, k]
        # [shifts, grid]: the score of a_k for every candidate (b_k, T_k).
        if offsets:
            errors = _grid_log_loss(prefix[seen], logits[seen, k], outcome, grid, shifts)
        else:
            scaled = logits[seen, k][None, :] / grid[:, None]  # [grid, n]
            errors = _ece_rows(prefix[seen] * _sigmoid(scaled), outcome, bins)[None]
        # Move away from T = 1, b = 0 only as far as it measurably helps: among the candidates
        # within SCORE_TOLERANCE of the best score, take the one closest to them (positions that almost
        # never survive otherwise drift to the grid's end for a negligible gain).
        near_b, near_t = np.nonzero(errors <= errors.min() + SCORE_TOLERANCE)
        pick = int(np.argmin(np.abs(shifts[near_b]) * 1e3 + np.abs(np.log(grid[near_t]))))
        b, t = float(shifts[near_b[pick]]), float(grid[near_t[pick]])
        temperatures.append(t)
        biases.append(b)
        prefix = prefix * _sigmoid(logits[:, k] / t + b)
    return temperatures, evaluate(rounds, temperatures, bins, biases if offsets else None)


def _ece_rows(candidates: np.ndarray, outcome: np.ndarray, bins: int) -> np.ndarray:
    return np.array([expected_calibration_error(a, outcome, bins) for a in candidates])


def _grid_log_loss(
    prefix: np.ndarray, logits: np.ndarray, outcome: np.ndarray, grid: np.ndarray, shifts: np.ndarray
) -> np.ndarray:
    """[shifts, grid] log loss of a = prefix * sigmoid(logits / T + b) against the outcomes.

    In float32 with torch's vectorised kernels (its sums are pairwise): the NumPy float64 grid
    (81 x 242 candidates over every round, per position) took minutes on 20,000 rounds. A miss
    scores log(1 - a) as log((1 - prefix) + prefix * sigmoid(-x)), a sum of two non-negative terms,
    so it keeps its precision where float32 would round a to 1."""
    hit = torch.from_numpy(outcome.astype(bool))
    z, p = torch.from_numpy(logits).float(), torch.from_numpy(prefix).float()
    inv_t = torch.from_numpy(1.0 / grid).float()[:, None]
    z_hit, p_hit = z[hit][None, :] * inv_t, p[hit]
    neg_z_miss, p_miss, q_miss = -z[~hit][None, :] * inv_t, p[~hit], 1 - p[~hit]
    out = np.empty((len(shifts), len(grid)))
    for i, b in enumerate(shifts.tolist()):
        log_a = torch.sigmoid(z_hit + b).mul_(p_hit).clamp_(min=1e-9).log_()
        log_not_a = torch.sigmoid(neg_z_miss - b).mul_(p_miss).add_(q_miss).clamp_(min=1e-9).log_()
        out[i] = -(log_a.sum(1).double() + log_not_a.sum(1).double()).numpy() / hit.numel()
    return out


def request_folds(rounds: RoundLog, folds: int) -> np.ndarray:
    """Fold index per round: each domain's requests dealt out in order of appearance, so a
    request's rounds share a fold and every fold holds every domain (given enough requests)."""
    fold = np.zeros(len(rounds), dtype=np.int64)
    for domain in np.unique(rounds.domain):
        in_domain = rounds.domain == domain
        for i, request in enumerate(dict.fromkeys(rounds.request[in_domain].tolist())):
            fold[in_domain & (rounds.request == request)] = i % folds
    return fold


def out_of_fold(
    rounds: RoundLog, folds: int, offsets: bool = False, bins: int = DEFAULT_BINS
) -> np.ndarray | None:
    """Calibrated a_k [N, gamma], each request's rounds scored by a map fitted without its fold:
    a held-out estimate that uses every prompt once (None with fewer than two folds' requests).

    One held-back quarter of ~200 prompts moves its ECE by a point or more with that quarter's
    base rate; pooled out-of-fold predictions do not."""
    if folds < 2:
        return None
    fold = request_folds(rounds, folds)
    if len(np.unique(fold)) < 2:
        return None
    calibrated = np.empty_like(rounds.conf_logits)
    for f in np.unique(fold):
        held = fold == f
        temperatures, reports = fit_sts(rounds.select(~held), bins=bins, offsets=offsets)
        shifts = [r.offset for r in reports]  # all 0 without offsets
        calibrated[held] = cumulative_confidence(rounds.conf_logits[held], temperatures, shifts)
    return calibrated


def evaluate(
    rounds: RoundLog,
    temperatures: list[float] | None,
    bins: int = DEFAULT_BINS,
    offsets: list[float] | None = None,
    calibrated: np.ndarray | None = None,
) -> list[PositionReport]:
    """ECE of a_k against prefix survival without and with `temperatures` (and `offsets`), and
    AUC, per position; `calibrated` (e.g. `out_of_fold`) replaces the map's a_k."""
    survived, observed = rounds.survival()
    raw = cumulative_confidence(rounds.conf_logits)
    if calibrated is None:
        calibrated = cumulative_confidence(rounds.conf_logits, temperatures, offsets)
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
                offset=float(offsets[k]) if offsets is not None and k < len(offsets) else 0.0,
                ece_before=expected_calibration_error(raw[seen, k], outcome, bins),
                ece_after=expected_calibration_error(calibrated[seen, k], outcome, bins),
                auc_before=roc_auc(raw[seen, k], outcome),
                auc_after=roc_auc(calibrated[seen, k], outcome),
            )
        )
    return reports
