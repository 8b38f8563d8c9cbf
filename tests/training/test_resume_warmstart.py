"""Runs resume from their checkpoint in any feature mode, and start from a trained drafter otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from dspark.cli import main
from dspark.drafters.checkpoint import read_state_dict
from dspark.training.build import drafter_raw_config, new_drafter
from dspark.training.config import TrainConfig
from dspark.training.run import build_trainer
from dspark.training.warmstart import find_warm_start, mismatch

from tests.training.conftest import tiny_config, write_prompts

REPO = Path(__file__).resolve().parents[2]


def _run(config: dict, tmp: Path, *args: str):
    path = tmp / f"{config['drafter']['kind']}-{len(list(tmp.glob('*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(config))
    return CliRunner().invoke(main, ["train", str(path), "--no-progress", *args])


def _trained(tmp: Path, target: Path, kind: str = "dspark") -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    config = tiny_config(tmp, target, kind, write_prompts(tmp / "prompts.jsonl", 30))
    result = _run(config, tmp)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return tmp / f"out-{kind}"


def test_a_run_interrupted_online_resumes_cached_to_the_same_step_and_weights(tmp_path, tiny_target):
    whole = _trained(tmp_path / "a", tiny_target)
    config = tiny_config(tmp_path, tiny_target, "dspark", write_prompts(tmp_path / "prompts.jsonl", 30))
    stopped = _run(config, tmp_path, "--stop-after", "4")
    assert stopped.exit_code == 0 and "stopped" in stopped.output
    state = torch.load(tmp_path / "out-dspark" / "state.pt", weights_only=False)
    assert state["step"] == 4 and state["optimizer"]["state"]  # Adam moments travel with the weights
    resumed = _run(config, tmp_path, "--features", "cached")
    assert resumed.exit_code == 0, resumed.output + repr(resumed.exception)
    info = json.loads((tmp_path / "out-dspark" / "final" / "training.json").read_text())
    assert info["steps"] == 6 and info["features"] == "cached"
    wa, wb = read_state_dict(whole / "final"), read_state_dict(tmp_path / "out-dspark" / "final")
    assert wa.keys() == wb.keys()
    for key in wa:  # steps 5-6 saw cached features: equal up to the forwards' rounding
        torch.testing.assert_close(wb[key].float(), wa[key].float(), rtol=2e-2, atol=2e-3, msg=key)


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_a_run_without_a_checkpoint_starts_from_the_named_drafter(tmp_path, tiny_target, kind):
    source = _trained(tmp_path / "a", tiny_target, kind) / "final"
    config = tiny_config(tmp_path, tiny_target, kind, write_prompts(tmp_path / "prompts.jsonl", 30))
    config["warm_start"] = str(source)
    config["optim"]["seed"] = 5  # another seed: the data's own vocabulary / init would differ
    trainer = build_trainer(TrainConfig.model_validate(config), progress=False)
    assert trainer.warm_start == str(source)
    own = trainer.model.state_dict()
    shared = set(trainer.model.shared_keys)
    warm = {k: v for k, v in read_state_dict(source).items() if k not in shared}
    assert warm  # every trained tensor of the source, the drafting vocabulary included
    for key, value in warm.items():
        torch.testing.assert_close(own[key].to(value.dtype), value, rtol=0, atol=0, msg=key)

    trainer.train(progress=False)
    info = json.loads((trainer.export() / "training.json").read_text())
    assert info["warm_start"] == str(source) and info["steps"] == 6


def test_warm_start_errors_and_auto(tmp_path, tiny_target):
    source = _trained(tmp_path / "a", tiny_target) / "final"
    config = tiny_config(tmp_path, tiny_target, "dspark", write_prompts(tmp_path / "prompts.jsonl", 30))
    config["drafter"]["markov_rank"] = 4  # another shape than the source's rank 8
    result = _run({**config, "warm_start": str(source)}, tmp_path)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "warm_start:" in result.output and "shapes differ in" in result.output
    other_vocab = {**config, "drafter": {**config["drafter"], "markov_rank": 8, "draft_vocab_size": 32}}
    result = _run({**other_vocab, "warm_start": str(source)}, tmp_path)
    assert result.exit_code != 0 and "drafts over 48 tokens, the config 32" in result.output
    result = _run({**config, "warm_start": "shipped"}, tmp_path)
    assert result.exit_code != 0 and "no shipped drafters for this target" in result.output
    # auto: nothing shipped for this target, so a fresh drafter (and the run says so).
    trainer = build_trainer(TrainConfig.model_validate({**config, "warm_start": "auto"}), progress=False)
    assert trainer.warm_start is None


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_the_shipped_configs_warm_start_from_the_shipped_drafters(smollm_dir, kind):
    cfg = TrainConfig.load(REPO / "configs" / "train" / f"smollm2-135m-{kind}.yaml")
    target = json.loads((smollm_dir / "config.json").read_text())
    warm = find_warm_start("auto", kind, target)
    assert warm is not None and warm.source.name == kind and not warm.required
    raw = drafter_raw_config(cfg.drafter, target, cfg.target_layer_ids, 0)
    zeros = torch.zeros(target["vocab_size"], target["hidden_size"])
    model = new_drafter(raw, zeros, zeros, None, None, warm.draft_vocab)
    assert mismatch(model, warm) is None
