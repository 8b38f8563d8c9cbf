"""load_drafter tells DSpark, DFlash and EAGLE-3 checkpoints apart by config.json."""

from __future__ import annotations

import json

import pytest
from dspark.drafters.dspark_drafter import DSparkDrafter
from dspark.drafters.factory import load_drafter

from tests.drafters.helpers import FIXTURE


def test_detects_dspark_with_its_head(target):
    drafter = load_drafter(str(FIXTURE / "draft_rnn"), target.config)
    assert isinstance(drafter, DSparkDrafter) and drafter.name == "dspark"
    assert type(drafter.model.markov_head).__name__ == "RNNHead"


def test_unknown_spec_and_architecture(tmp_path, target):
    with pytest.raises(ValueError, match="unknown drafter 'no-such-thing'"):
        load_drafter("no-such-thing", target.config)
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "vocab_size": 1024,
                "hidden_size": 64,
                "num_attention_heads": 4,
            }
        )
    )
    with pytest.raises(ValueError, match="unknown drafter architecture 'Qwen3ForCausalLM'"):
        load_drafter(str(tmp_path), target.config)


def test_gamma_override(target):
    drafter = load_drafter(str(FIXTURE / "draft_vanilla"), target.config, gamma=4)
    assert drafter.gamma == 4 and drafter.model.block_len == 4
