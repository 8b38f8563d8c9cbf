"""Loading DeepSpec's Qwen3DSparkModel checkpoints reproduces its reference drafting round."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from dspark.drafters.checkpoint import (
    load_draft_model,
    load_target_shared_weights,
    read_state_dict,
    save_draft_model,
)
from dspark.drafters.config import TargetShape
from safetensors.torch import load_file

from tests.drafters.helpers import FIXTURE, TARGET_LAYERS, VARIANTS

TOL = {"atol": 1e-4, "rtol": 1e-4}


def expected(variant: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURE / f"draft_{variant}" / "expected.safetensors")


@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_round_reproduced(variant, target):
    exp = expected(variant)
    model = load_draft_model(FIXTURE / f"draft_{variant}", target=target.config)
    assert model.config.kind == "dspark" and model.config.markov_head_type == variant
    assert model.config.target_layer_ids == TARGET_LAYERS and model.config.gamma == 7

    with torch.no_grad():
        out = target(exp["prompt_ids"], output_hidden_states=True)
        features = torch.cat([out.hidden_states[i + 1] for i in TARGET_LAYERS], dim=-1)
        anchor = out.logits[:, -1].argmax(-1)
        torch.testing.assert_close(features, exp["target_context_features"], **TOL)
        assert torch.equal(anchor, exp["anchor_id"])
        assert torch.equal(model.block_input_ids(anchor), exp["draft_input_ids"])

        hidden = model(features, anchor)
        torch.testing.assert_close(hidden, exp["block_hidden"], **TOL)
        torch.testing.assert_close(model.lm_head(hidden), exp["base_logits"], **TOL)
        logits, conf = model.teacher_forced(hidden, anchor, exp["greedy_draft_tokens"])
    torch.testing.assert_close(logits, exp["corrected_logits"], **TOL)
    torch.testing.assert_close(conf, exp["confidence_logits"], **TOL)
    # Greedy left-to-right sampling: each token is the argmax given the previously chosen one.
    assert torch.equal(logits.argmax(-1), exp["greedy_draft_tokens"])


def test_sequential_head_changes_logits():
    """The heads really contribute: corrected logits differ from base logits in every variant."""
    for variant in VARIANTS:
        exp = expected(variant)
        assert not torch.allclose(exp["corrected_logits"], exp["base_logits"], atol=1e-3)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("vocab_size", 2048, "vocabulary size 1024 != target's 2048"),
        ("hidden_size", 128, "hidden size 64 != target's 128"),
        ("num_hidden_layers", 4, "num_target_layers 6 != target's 4"),
    ],
)
def test_refuses_mismatched_target(field, value, message, target):
    shape = TargetShape.of(target.config).model_dump() | {field: value}
    with pytest.raises(ValueError, match=message):
        load_draft_model(FIXTURE / "draft_vanilla", target=shape)


def test_refuses_target_layers_outside_target(tmp_path):
    ckpt = tmp_path / "draft"
    shutil.copytree(FIXTURE / "draft_vanilla", ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config.pop("num_target_layers")
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"target layers \[4\] outside the target's 0..3"):
        load_draft_model(ckpt, target={"vocab_size": 1024, "hidden_size": 64, "num_hidden_layers": 4})


def test_target_shape_from_directory():
    assert TargetShape.of(FIXTURE / "target") == TargetShape(
        vocab_size=1024, hidden_size=64, num_hidden_layers=6
    )


def test_checkpoint_without_shared_weights_uses_the_targets(tmp_path, target):
    model = load_draft_model(FIXTURE / "draft_gated")
    save_draft_model(model, tmp_path / "own")
    assert "embed_tokens.weight" not in read_state_dict(tmp_path / "own")
    with pytest.raises(ValueError, match=r"lacks weights .*embed_tokens\.weight.*SharedWeights"):
        load_draft_model(tmp_path / "own", target=target.config)

    shared = load_target_shared_weights(FIXTURE / "target")
    reloaded = load_draft_model(tmp_path / "own", target=target.config, shared=shared)
    assert reloaded.embed_tokens.weight.data_ptr() == shared.embed_tokens.data_ptr()  # shared, not copied
    for key, value in model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[key], value, atol=0, rtol=0)


def test_unexpected_weights_refused(tmp_path):
    ckpt = tmp_path / "draft"
    shutil.copytree(FIXTURE / "draft_vanilla", ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | {"markov_head_type": "none"}))
    with pytest.raises(ValueError, match=r"does not use: .*markov_head\.markov_w1\.weight"):
        load_draft_model(ckpt)


def test_bf16_load_close_to_fp32(target):
    exp = expected("vanilla")
    model = load_draft_model(FIXTURE / "draft_vanilla", dtype=torch.bfloat16)
    assert model.fc.weight.dtype == torch.bfloat16
    with torch.no_grad():
        hidden = model(exp["target_context_features"].bfloat16(), exp["anchor_id"])
    assert hidden.dtype == torch.bfloat16
    torch.testing.assert_close(hidden.float(), exp["block_hidden"], atol=0.1, rtol=0.05)
