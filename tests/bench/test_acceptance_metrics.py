"""Acceptance metrics from recorded rounds, against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest
from dspark.bench.acceptance import (
    AcceptanceRun,
    format_markdown,
    position_acceptance,
    ratios,
    summarize_run,
    threshold_sweep,
)
from dspark.calibration.rounds import RoundLog


def test_position_acceptance():
    unconditional, conditional = position_acceptance(np.array([0, 1, 3, 3]), gamma=3)
    assert unconditional == pytest.approx([3 / 4, 2 / 4, 2 / 4])
    assert conditional == pytest.approx([3 / 4, 2 / 3, 1.0])


def test_threshold_sweep_verifies_up_to_first_low_confidence():
    conf = np.array([[0.9, 0.4, 0.9], [0.9, 0.9, 0.9]])
    accepted = np.array([2, 1])
    rows = {r["threshold"]: r for r in threshold_sweep(conf, accepted, thresholds=(0.0, 0.5, 0.95))}
    # x = 0: whole blocks (3 + 3 verified), accepted 2 + 1.
    assert rows[0.0]["acceptance_rate"] == pytest.approx(3 / 6) and rows[0.0]["tokens_per_round"] == 2.5
    # x = 0.5: first block stops before position 2 -> verified 1, accepted min(2, 1) = 1; second whole.
    assert rows[0.5]["verified_per_round"] == 2.0
    assert rows[0.5]["acceptance_rate"] == pytest.approx(2 / 4) and rows[0.5]["tokens_per_round"] == 2.0
    # x = 0.95: nothing verified.
    assert np.isnan(rows[0.95]["acceptance_rate"]) and rows[0.95]["tokens_per_round"] == 1.0


def _run(label, kind, accepted, domain_split=True):
    n = len(accepted)
    domains = np.array(["math", "chat"] * (n // 2)) if domain_split else np.array(["math"] * n)
    rounds = RoundLog(np.zeros((n, 3)), accepted, [3] * n, domains, [f"{d}/0" for d in domains])
    return AcceptanceRun(label, kind, 3, 3, 1.0, rounds, None)


def test_tau_macro_and_ratios():
    dspark = summarize_run(_run("dspark", "dspark", [3, 1, 3, 1]))  # math: 3, 3 -> tau 4; chat: 1, 1 -> 2
    dflash = summarize_run(_run("dflash", "dflash", [1, 0, 1, 0]))  # math tau 2, chat tau 1
    assert dspark["domains"]["math"]["tau"] == 4.0 and dspark["domains"]["chat"]["tau"] == 2.0
    assert dspark["macro_tau"] == 3.0 and dflash["macro_tau"] == 1.5
    assert dspark["domains"]["math"]["acceptance_rate"] == 1.0
    (r,) = ratios([dspark, dflash])
    assert r["ratio"] == 2.0 and (r["numerator"], r["denominator"]) == ("dspark", "dflash")
    table = format_markdown([dspark, dflash], {"target": "t", "num_prompts": 1, "max_tokens": 8})
    assert "| dspark | dspark | 3 | 1 | 4.00 | 2.00 | 3.00 |" in table
    assert "| 3 | 1 | dspark / dflash | 2.000 |" in table


def test_cut_rounds_are_left_out_of_tau():
    rounds = RoundLog(np.zeros((2, 3)), [3, 0], [3, 0], ["math", "math"], ["math/0", "math/0"])
    s = summarize_run(AcceptanceRun("x", "dspark", 3, 3, 0.0, rounds, None))
    assert s["domains"]["math"]["rounds"] == 1 and s["domains"]["math"]["tau"] == 4.0
