"""The drafters shipped for SmolLM2-135M: resolvable by name, complete, loadable, within budget."""

from __future__ import annotations

import pytest
import torch
from dspark.drafters.checkpoint import SharedWeights, load_draft_model, read_state_dict
from dspark.drafters.config import TargetShape
from dspark.drafters.shipped import SHIPPED_NAMES, SHIPPED_ROOT, shipped_drafter

SMOLLM = TargetShape(vocab_size=49152, hidden_size=576, num_hidden_layers=30)


def test_every_name_resolves_for_the_default_target():
    for name in SHIPPED_NAMES:
        path = shipped_drafter(name, SMOLLM)
        assert path == SHIPPED_ROOT / "smollm2-135m" / name
        assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def test_a_target_without_shipped_drafters_is_refused_by_name(tiny_target):
    with pytest.raises(ValueError, match=r"no shipped drafters for this target.*smollm2-135m"):
        shipped_drafter("dspark", tiny_target)


def test_shipped_files_fit_the_budget_and_leave_the_shared_weights_out():
    total = sum(f.stat().st_size for f in (SHIPPED_ROOT / "smollm2-135m").rglob("*.safetensors"))
    assert total <= 60 * 1024 * 1024, f"shipped drafters take {total / 2**20:.1f} MiB"
    for name in SHIPPED_NAMES:
        state = read_state_dict(SHIPPED_ROOT / "smollm2-135m" / name)
        assert "embed_tokens.weight" not in state
        assert all(t.dtype in (torch.bfloat16, torch.long, torch.bool) for t in state.values())


@pytest.mark.parametrize("name", SHIPPED_NAMES)
def test_shipped_drafter_loads_against_the_default_shape(name):
    shared = SharedWeights(torch.zeros(49152, 576, dtype=torch.bfloat16), torch.zeros(49152, 576, dtype=torch.bfloat16))
    model = load_draft_model(shipped_drafter(name, SMOLLM), SMOLLM, shared=shared, dtype=torch.bfloat16)
    assert model.config.kind == name and model.config.gamma == 7
    assert tuple(model.config.target_layer_ids) == (1, 14, 26)
