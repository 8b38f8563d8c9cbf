"""`dspark calibrate` writes a calibration the engine's loader applies, and only for its own drafter."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from dspark.cli import main
from dspark.drafters.calibration import Calibration, drafter_id
from dspark.drafters.factory import load_drafter
from safetensors.torch import load_file, save_file

from tests.calibration.helpers import copy_drafter
from tests.calibration.synthetic import overconfident_rounds
from tests.drafters.helpers import FIXTURE, make_request, sampling_for, target_features


def test_calibrate_from_rounds_writes_what_the_loader_applies(tmp_path, target):
    ckpt = copy_drafter("gated", tmp_path / "gated")
    rounds_path = tmp_path / "rounds.npz"
    overconfident_rounds(n=20_000).save(rounds_path)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main, ["calibrate", str(ckpt), "--rounds", str(rounds_path), "--output-dir", str(out)]
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "calibration-report.json").read_text())
    assert report["drafter_id"] == drafter_id(ckpt)
    assert all(p["ece_after"] <= 0.02 < p["ece_before"] for p in report["fit"])
    assert all(p["ece_after"] <= 0.02 for p in report["check"])  # held-back requests
    assert (out / "reliability.png").stat().st_size > 10_000
    assert "ECE before" in result.output

    calibration = Calibration.find(ckpt, 7)
    assert calibration is not None and calibration.temperatures == report["temperatures"]
    assert calibration.offsets == report["offsets"]
    # The engine's loader applies it: c_k = sigmoid(raw logit_k / T_k + b_k).
    exp = load_file(FIXTURE / "draft_gated" / "expected.safetensors")
    prompt = exp["prompt_ids"][0].tolist()
    request = make_request("r", [*prompt, int(exp["anchor_id"])], num_cached=len(prompt))
    drafter = load_drafter(str(ckpt), target.config)
    drafter.admit(request)
    drafter.commit([request], [target_features(target, prompt)])
    block = drafter.propose([request], sampling_for([request]))
    want = torch.sigmoid(
        exp["confidence_logits"] / torch.tensor(calibration.temperatures) + torch.tensor(calibration.offsets)
    )
    torch.testing.assert_close(block.confidences, want, atol=1e-5, rtol=1e-5)


def test_calibration_of_another_drafter_is_refused(tmp_path, target):
    gated = copy_drafter("gated", tmp_path / "gated")
    other = copy_drafter("gated", tmp_path / "retrained")
    weights = load_file(other / "model.safetensors")
    weights["confidence_head.proj.bias"] = (
        weights["confidence_head.proj.bias"] + 0.1
    )  # same shape, new weights
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    assert drafter_id(gated) != drafter_id(other)

    Calibration(drafter_id=drafter_id(gated), temperatures=[2.0] * 7).save(other)
    with pytest.raises(
        ValueError, match=r"was fitted for drafter sha256:\w+, but this checkpoint is sha256:\w+"
    ):
        load_drafter(str(other), target.config)
    Calibration(drafter_id=drafter_id(gated), temperatures=[2.0] * 7).save(gated)
    assert load_drafter(str(gated), target.config).gamma == 7  # its own drafter loads it


def test_drafter_id_ignores_the_calibration_file(tmp_path):
    ckpt = copy_drafter("vanilla", tmp_path / "vanilla")
    before = drafter_id(ckpt)
    Calibration(drafter_id=before, temperatures=[1.5] * 7).save(ckpt)
    assert drafter_id(ckpt) == before


def test_calibrate_refuses_bad_input(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["calibrate", str(tmp_path / "nowhere")])
    assert result.exit_code != 0 and "neither a checkpoint directory" in result.output
    ckpt = copy_drafter("vanilla", tmp_path / "vanilla")
    no_conf = tmp_path / "r.npz"
    import numpy as np
    from dspark.calibration.rounds import RoundLog

    RoundLog(np.full((3, 7), np.nan), [0, 1, 7], [7, 7, 7]).save(no_conf)
    result = runner.invoke(
        main, ["calibrate", str(ckpt), "--rounds", str(no_conf), "--output-dir", str(tmp_path)]
    )
    assert result.exit_code != 0 and "has no confidence head" in result.output
    assert not (ckpt / "calibration.json").exists()


def test_greedy_rounds_write_the_greedy_map_and_keep_the_sampled_one(tmp_path):
    ckpt = copy_drafter("gated", tmp_path / "gated")
    sampled_rounds, greedy_rounds = tmp_path / "sampled.npz", tmp_path / "greedy.npz"
    overconfident_rounds(n=6000).save(sampled_rounds)
    overconfident_rounds(n=6000, scale=1.0, shift=1.5, seed=2).save(greedy_rounds)
    runs = {}
    for name, path, temperature in (("sampled", sampled_rounds, "1.0"), ("greedy", greedy_rounds, "0")):
        out = tmp_path / name
        args = ["calibrate", str(ckpt), "--rounds", str(path), "--temperature", temperature, "--folds", "0"]
        result = CliRunner().invoke(main, [*args, "--output-dir", str(out)])
        assert result.exit_code == 0, result.output
        runs[name] = json.loads((out / "calibration-report.json").read_text())
    calibration = Calibration.find(ckpt, 7)
    assert calibration.temperatures == runs["sampled"]["temperatures"]
    assert calibration.greedy_temperatures == runs["greedy"]["temperatures"]
    assert calibration.greedy_offsets == runs["greedy"]["offsets"] != calibration.offsets
    assert calibration.for_temperature(0.0)[0] != calibration.for_temperature(0.8)[0]
