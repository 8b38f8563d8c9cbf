"""A small acceptance bench on the tiny DeepSpec fixture: every output file, consistent numbers."""

from __future__ import annotations

import json

import pytest
from dspark.bench.acceptance import run_acceptance, write_report
from dspark.drafters.calibration import Calibration, drafter_id

from tests.calibration.helpers import copy_drafter, fixture_engine, fixture_prompts


def test_fixture_acceptance_bench(tmp_path):
    rnn = copy_drafter("rnn", tmp_path / "rnn")
    Calibration(drafter_id=drafter_id(rnn), temperatures=[0.5] * 7).save(rnn)
    drafters = {"vanilla": copy_drafter("vanilla", tmp_path / "vanilla"), "rnn": rnn}
    runs = run_acceptance(
        fixture_engine(),
        drafters,
        fixture_prompts(per_domain=1),
        temperatures=[1.0, 0.0],
        gammas=[None, 4],
        max_tokens=12,
    )
    assert [(r.label, r.gamma, r.temperature) for r in runs] == [
        (label, g, t) for label in drafters for g in (7, 4) for t in (1.0, 0.0)
    ]
    files = write_report(runs, {"target": "fixture", "num_prompts": 1, "max_tokens": 12}, tmp_path / "out")
    for path in files.values():
        assert path.stat().st_size > 0
    for name in ("per_position.png", "threshold_sweep.png"):
        assert (tmp_path / "out" / name).stat().st_size > 10_000

    report = json.loads(files["json"].read_text())
    assert len(report["runs"]) == 8
    for run in report["runs"]:
        for domain, m in run["domains"].items():
            assert domain in ("math", "code")
            assert 1.0 <= m["tau"] <= 1 + run["gamma"]
            assert m["tau"] - 1 == pytest.approx(
                sum(m["unconditional"])
            )  # E[accepted] = sum_k P(accepted >= k)
            assert len(m["conditional"]) == run["gamma"]
            assert m["threshold_sweep"][0]["threshold"] == 0.0
            assert m["threshold_sweep"][0]["tokens_per_round"] == m["tau"]  # threshold 0 = full block
        assert run["calibrated"] == (run["drafter"] == "rnn")
    rnn_run = next(r for r in report["runs"] if r["drafter"] == "rnn")
    assert "ece_calibrated" in rnn_run["domains"]["math"]
    table = files["markdown"].read_text()
    assert "| rnn | dspark | 4 (trained 7) | 0 |" in table
