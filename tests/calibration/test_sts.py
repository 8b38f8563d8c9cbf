"""Sequential Temperature Scaling fixes over-confident confidences and keeps their order."""

from __future__ import annotations

import numpy as np
import pytest
from dspark.calibration.rounds import RoundLog, confidences, cumulative_confidence
from dspark.calibration.sts import evaluate, fit_sts, out_of_fold, request_folds

from tests.calibration.synthetic import overconfident_rounds


def test_sts_brings_every_position_under_two_percent():
    rounds = overconfident_rounds(n=20_000)
    temperatures, report = fit_sts(rounds)
    assert len(temperatures) == rounds.gamma
    for r in report:
        assert r.ece_before > 0.03, r  # the raw confidences really are miscalibrated
        assert r.ece_after <= 0.02, r
    # The true temperature is 3 at every position; where many prefixes survive it is well identified.
    assert np.allclose(temperatures[:4], 3.0, rtol=0.1)
    # And it holds on fresh rounds from the same distribution, not only on the fitted ones.
    fresh = evaluate(overconfident_rounds(n=20_000, seed=1), temperatures)
    assert max(r.ece_after for r in fresh) <= 0.02


def test_offsets_fix_a_shifted_head_that_temperature_alone_cannot():
    """A head whose logits are all 1.5 too high: no temperature brings it under 2%, an offset does
    (b ~ -1.5, T ~ 1), fitted by log loss so the confidences keep their spread and order."""
    rounds = overconfident_rounds(n=20_000, scale=1.0, shift=1.5)
    _, plain = fit_sts(rounds)
    assert plain[0].ece_after > 0.03
    temperatures, report = fit_sts(rounds, offsets=True)
    offsets = [r.offset for r in report]
    assert max(r.ece_after for r in report) <= 0.02
    assert offsets[0] == pytest.approx(-1.5, abs=0.15) and temperatures[0] == pytest.approx(1.0, abs=0.1)
    fresh = evaluate(
        overconfident_rounds(n=20_000, scale=1.0, shift=1.5, seed=1), temperatures, offsets=offsets
    )
    assert max(r.ece_after for r in fresh) <= 0.02
    raw, calibrated = rounds.conf_logits[:, 0], confidences(rounds.conf_logits, temperatures, offsets)[:, 0]
    assert np.array_equal(np.argsort(raw, kind="stable"), np.argsort(calibrated, kind="stable"))
    assert calibrated.std() > 0.15  # not squashed to the base rate (which an ECE objective would reward)


def test_calibration_preserves_order():
    rounds = overconfident_rounds(n=2000)
    temperatures, report = fit_sts(rounds)
    raw, calibrated = confidences(rounds.conf_logits), confidences(rounds.conf_logits, temperatures)
    for k in range(rounds.gamma):
        assert np.array_equal(
            np.argsort(raw[:, k], kind="stable"), np.argsort(calibrated[:, k], kind="stable")
        )
    # Position 1's a_1 is c_1 itself, so its AUC cannot move; the informative confidences rank well.
    assert report[0].auc_after == pytest.approx(report[0].auc_before)
    assert all(r.auc_before > 0.7 and abs(r.auc_after - r.auc_before) < 0.02 for r in report)


def test_cut_blocks_count_only_where_observed():
    """A block cut to 2 verified tokens, both accepted, says nothing about position 3."""
    rounds = RoundLog(np.zeros((3, 3)), accepted=[2, 1, 0], verified=[2, 3, 1])
    survived, observed = rounds.survival()
    assert observed.tolist() == [[True, True, False], [True, True, True], [True, True, True]]
    assert survived.tolist() == [[True, True, False], [True, False, False], [False, False, False]]
    assert len(rounds.full_blocks()) == 1


def test_cumulative_product_and_partial_temperatures():
    logits = np.array([[0.0, 2.0, -1.0]])
    a = cumulative_confidence(logits, [1.0, 2.0])  # position 3 keeps T = 1
    c = 1 / (1 + np.exp(-np.array([0.0, 1.0, -1.0])))
    assert a[0] == pytest.approx(np.cumprod(c))


def test_refuses_rounds_without_confidences_and_bad_counts():
    with pytest.raises(ValueError, match="no confidence logits"):
        fit_sts(RoundLog(np.full((4, 2), np.nan), [0, 1, 2, 2], [2, 2, 2, 2]))
    with pytest.raises(ValueError, match=r"accepted counts must lie in \[0, verified\]"):
        RoundLog(np.zeros((1, 2)), [3], [2])


def test_round_log_save_load(tmp_path):
    rounds = overconfident_rounds(n=50)
    rounds.save(tmp_path / "r.npz")
    back = RoundLog.load(tmp_path / "r.npz")
    assert np.array_equal(back.conf_logits, rounds.conf_logits)
    assert back.request.tolist() == rounds.request.tolist() and back.domain.tolist() == rounds.domain.tolist()


def test_position_that_never_survives_keeps_temperature_near_one():
    """With no survivors past position 1 every sharper T looks marginally better; STS stays near 1."""
    rng = np.random.default_rng(0)
    logits = rng.normal(-3.0, 0.5, size=(500, 3))
    logits[:, 0] = rng.normal(0.0, 1.0, 500)
    accepted = (rng.random(500) < 1 / (1 + np.exp(-logits[:, 0]))).astype(int)  # 0 or 1, never 2+
    temperatures, _ = fit_sts(RoundLog(logits, accepted, np.full(500, 3)))
    assert 0.5 < temperatures[2] <= 1.0


def test_request_folds_keep_requests_whole_and_spread_domains():
    rounds = overconfident_rounds(n=3000)
    fold = request_folds(rounds, 4)
    for request in np.unique(rounds.request):
        assert len(np.unique(fold[rounds.request == request])) == 1
    for domain in np.unique(rounds.domain):
        assert set(fold[rounds.domain == domain]) == {0, 1, 2, 3}


def test_out_of_fold_scores_each_fold_with_a_map_fitted_without_it():
    rounds = overconfident_rounds(n=8000)
    held_out = out_of_fold(rounds, 4)
    fold = request_folds(rounds, 4)
    temperatures, _ = fit_sts(rounds.select(fold != 2))
    np.testing.assert_allclose(
        held_out[fold == 2], cumulative_confidence(rounds.conf_logits[fold == 2], temperatures)
    )
    report = evaluate(rounds, temperatures, calibrated=held_out)
    assert all(r.ece_after <= 0.02 < r.ece_before for r in report[:3])
    assert out_of_fold(rounds, 1) is None and out_of_fold(rounds, 0) is None
    assert out_of_fold(rounds.select(rounds.request == rounds.request[0]), 4) is None  # one request
