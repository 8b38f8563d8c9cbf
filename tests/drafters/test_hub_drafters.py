"""Drafters by hub id: DeepSpec's published DSpark layout, DFlash and EAGLE-3 checkpoints, downloaded
from a loopback hub and loaded as from a directory."""

from __future__ import annotations

import json

import pytest
import torch
from dspark.drafters.checkpoint import SharedWeights, load_draft_model, read_state_dict
from dspark.drafters.factory import checkpoint_dir, load_drafter
from dspark.drafters.shipped import SHIPPED_ROOT
from dspark.models.pull import ModelError
from safetensors.torch import load_file

from tests.drafters.helpers import FIXTURE, TARGET_LAYERS
from tests.hub_emulator import HubEmulator, repo_from_dir

TOL = {"atol": 1e-4, "rtol": 1e-4}
SMOLLM_DRAFTERS = SHIPPED_ROOT / "smollm2-135m"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    repos = {
        "deepseek-ai/dspark_tiny_block7": repo_from_dir(
            FIXTURE / "draft_gated", skip=("expected.safetensors",)
        ),
        "org/smollm-dflash": repo_from_dir(SMOLLM_DRAFTERS / "dflash"),
        "org/smollm-eagle3": repo_from_dir(SMOLLM_DRAFTERS / "eagle3"),
    }
    with HubEmulator(repos) as emulator:
        monkeypatch.setenv("HF_ENDPOINT", emulator.endpoint)
        yield emulator


def test_deepspec_dspark_by_hub_id_reproduces_its_reference_round(hub, target):
    exp = load_file(FIXTURE / "draft_gated" / "expected.safetensors")
    model = load_draft_model(checkpoint_dir("deepseek-ai/dspark_tiny_block7"), target=target.config)
    assert model.config.kind == "dspark" and model.config.markov_head_type == "gated"
    with torch.no_grad():
        out = target(exp["prompt_ids"], output_hidden_states=True)
        features = torch.cat([out.hidden_states[i + 1] for i in TARGET_LAYERS], dim=-1)
        hidden = model(features, exp["anchor_id"])
        logits, conf = model.teacher_forced(hidden, exp["anchor_id"], exp["greedy_draft_tokens"])
    torch.testing.assert_close(hidden, exp["block_hidden"], **TOL)
    torch.testing.assert_close(logits, exp["corrected_logits"], **TOL)
    torch.testing.assert_close(conf, exp["confidence_logits"], **TOL)


@pytest.mark.parametrize(("repo", "kind"), [("org/smollm-dflash", "dflash"), ("org/smollm-eagle3", "eagle3")])
def test_dflash_and_eagle3_by_hub_id_load_the_published_weights(hub, repo, kind):
    local = SMOLLM_DRAFTERS / kind
    target = {"vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30}
    shared = SharedWeights(torch.randn(49152, 576), torch.randn(49152, 576))
    assert load_drafter(repo, target, shared=shared).model.config.kind == kind
    model = load_draft_model(checkpoint_dir(repo), target=target, shared=shared)
    want, got = read_state_dict(local), model.state_dict()
    assert want.keys() <= got.keys() and all(torch.equal(got[k], v.float()) for k, v in want.items())
    assert json.loads((checkpoint_dir(repo) / "config.json").read_text()) == json.loads(
        (local / "config.json").read_text()
    )


def test_unknown_drafter_repository_is_named(hub):
    with pytest.raises(ModelError, match=r"cannot get drafter 'org/none'.*no such repository"):
        checkpoint_dir("org/none")
