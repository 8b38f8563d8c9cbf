"""ECE over equal-width bins and ROC-AUC against direct definitions."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from dspark.calibration.metrics import expected_calibration_error, reliability_bins, roc_auc


def test_ece_by_hand():
    probs = np.array([0.05, 0.15, 0.95, 0.95, 1.0])
    outcomes = np.array([0, 1, 1, 0, 1])
    # 10 bins: [0.05] -> 0, [0.15] -> 1, [0.95, 0.95, 1.0] -> 9.
    want = (1 * 0.05 + 1 * 0.85 + 3 * abs((0.95 + 0.95 + 1.0) / 3 - 2 / 3)) / 5
    assert expected_calibration_error(probs, outcomes, bins=10) == pytest.approx(want)
    bins = reliability_bins(probs, outcomes, bins=10)
    assert bins.count.tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 0, 3]


def test_ece_zero_when_calibrated_and_large_when_not():
    rng = np.random.default_rng(0)
    p = rng.random(200_000)
    y = rng.random(p.size) < p
    assert expected_calibration_error(p, y) < 0.005
    assert expected_calibration_error(np.sqrt(p), y) > 0.1


def test_auc_matches_pairwise_count_with_ties():
    rng = np.random.default_rng(1)
    scores = rng.integers(0, 5, 60).astype(float)  # many ties
    y = rng.random(60) < 0.4
    pos, neg = scores[y], scores[~y]
    pairs = [(a > b) + 0.5 * (a == b) for a, b in itertools.product(pos, neg)]
    assert roc_auc(scores, y) == pytest.approx(np.mean(pairs))
    assert roc_auc(np.array([0.1, 0.9]), np.array([0, 1])) == 1.0
    assert np.isnan(roc_auc(np.array([0.1, 0.9]), np.array([1, 1])))


def test_bad_input():
    with pytest.raises(ValueError, match="2 predictions but 3 outcomes"):
        expected_calibration_error(np.array([0.1, 0.2]), np.array([0, 1, 1]))
    with pytest.raises(ValueError, match="finite"):
        roc_auc(np.array([np.nan, 0.2]), np.array([0, 1]))
