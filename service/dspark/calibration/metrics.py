"""Calibration metrics: expected calibration error (equal-width bins), ROC-AUC, reliability bins."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_BINS = 10


@dataclass
class ReliabilityBins:
    """Per equal-width bin: mean predicted probability, observed frequency and sample count."""

    edges: np.ndarray  # [bins + 1]
    confidence: np.ndarray  # [bins], NaN for empty bins
    frequency: np.ndarray  # [bins], NaN for empty bins
    count: np.ndarray  # [bins]


def reliability_bins(probs: np.ndarray, outcomes: np.ndarray, bins: int = DEFAULT_BINS) -> ReliabilityBins:
    """Bin `probs` into `bins` equal-width bins over [0, 1] (1.0 falls in the last bin)."""
    probs, outcomes = _check(probs, outcomes)
    edges = np.linspace(0.0, 1.0, bins + 1)
    index = np.clip(np.digitize(probs, edges[1:-1], right=False), 0, bins - 1)
    count = np.bincount(index, minlength=bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        confidence = np.bincount(index, weights=probs, minlength=bins) / count
        frequency = np.bincount(index, weights=outcomes.astype(float), minlength=bins) / count
    return ReliabilityBins(edges, confidence, frequency, count)


def expected_calibration_error(probs: np.ndarray, outcomes: np.ndarray, bins: int = DEFAULT_BINS) -> float:
    """ECE = sum_b (n_b / n) |mean prob_b - frequency_b| over equal-width bins."""
    r = reliability_bins(probs, outcomes, bins)
    used = r.count > 0
    if not used.any():
        raise ValueError("ECE needs at least one sample")
    gaps = np.abs(r.confidence[used] - r.frequency[used])
    return float(np.sum(r.count[used] * gaps) / r.count.sum())


def roc_auc(scores: np.ndarray, outcomes: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties); NaN when one class is absent."""
    scores, outcomes = _check(scores, outcomes)
    positives = int(outcomes.sum())
    negatives = outcomes.size - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(scores.size, dtype=float)
    # Average rank (1-based) over each run of tied scores.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], scores.size]
    for start, end in zip(starts, ends, strict=True):
        ranks[order[start:end]] = (start + end + 1) / 2.0
    u = ranks[outcomes.astype(bool)].sum() - positives * (positives + 1) / 2.0
    return float(u / (positives * negatives))


def _check(probs: np.ndarray, outcomes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    probs = np.asarray(probs, dtype=float).ravel()
    outcomes = np.asarray(outcomes).ravel()
    if probs.shape != outcomes.shape:
        raise ValueError(f"{probs.size} predictions but {outcomes.size} outcomes")
    if not np.all(np.isfinite(probs)):
        raise ValueError("predictions must be finite")
    return probs, outcomes.astype(bool)
