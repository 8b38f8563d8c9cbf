"""Recorded rounds agree with what the engine did, and confidences are the drafter's raw ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dspark.calibration.collect import collect_rounds
from dspark.drafters.calibration import Calibration, drafter_id

from tests.calibration.helpers import copy_drafter, fixture_engine, fixture_prompts
from tests.drafters.helpers import FIXTURE


def test_rounds_match_engine_statistics(tmp_path):
    engine = fixture_engine()
    prompts = fixture_prompts()
    rounds = collect_rounds(engine, FIXTURE / "draft_gated", prompts, temperature=1.0, max_tokens=20)
    assert rounds.gamma == 7 and rounds.has_confidences
    assert sorted(set(rounds.domain.tolist())) == ["code", "math"]
    assert set(rounds.request.tolist()) == {f"{d}/{i}" for d in prompts for i in range(3)}
    # The fixture has no EOS, so every request runs to max_tokens = 20: the prefill's token plus
    # (accepted + bonus) per round, and no round ever verifies past what max_tokens leaves room for.
    for request in set(rounds.request.tolist()):
        mine = rounds.request == request
        assert 1 + int(mine.sum()) + int(rounds.accepted[mine].sum()) == 20
    assert np.all(rounds.verified <= 7) and np.all(rounds.accepted <= rounds.verified)
    # max_tokens cuts the last rounds short, so there are both full and cut blocks.
    assert 0 < len(rounds.full_blocks()) < len(rounds)


def test_recorded_logits_ignore_calibration_file(tmp_path):
    """Rounds hold raw logits even when a calibration sits beside the checkpoint."""
    ckpt = copy_drafter("gated", tmp_path / "gated")
    prompts = fixture_prompts(("math",), per_domain=2)
    plain = collect_rounds(fixture_engine(), ckpt, prompts, temperature=0.0, max_tokens=10)
    Calibration(drafter_id=drafter_id(ckpt), temperatures=[5.0] * 7).save(ckpt)
    again = collect_rounds(fixture_engine(), ckpt, prompts, temperature=0.0, max_tokens=10)
    assert np.array_equal(plain.accepted, again.accepted)
    torch.testing.assert_close(torch.from_numpy(again.conf_logits), torch.from_numpy(plain.conf_logits))
    assert plain.conf_logits.std() > 0.01  # real per-round logits, not a constant


def test_shipped_names_resolve_under_the_target(tmp_path, monkeypatch):
    from dspark.calibration import collect

    monkeypatch.setattr(collect, "SHIPPED_DIR", tmp_path)
    ckpt = copy_drafter("gated", tmp_path / "smollm2-135m" / "dspark")
    assert collect.resolve_drafter_dir("dspark", "smollm2-135m") == ckpt
    assert collect.resolve_drafter_dir(str(ckpt), "anything") == ckpt
    with pytest.raises(ValueError, match="neither a checkpoint directory"):
        collect.resolve_drafter_dir("eagle3", "smollm2-135m")


def test_fresh_copy_records_apart():
    from dspark.calibration.recording import RecordingDrafter

    from tests.drafters.helpers import PerEngineNgram

    recorder = RecordingDrafter(PerEngineNgram(4))
    copy = recorder.fresh_copy()
    assert isinstance(copy, RecordingDrafter) and isinstance(copy.inner, PerEngineNgram)
    assert copy.inner is not recorder.inner and copy.gamma == 4
