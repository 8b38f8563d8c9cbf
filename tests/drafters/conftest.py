"""The tiny DeepSpec reference target, loaded once with HF transformers (independent of the engine)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3ForCausalLM

from tests.drafters.helpers import FIXTURE


@pytest.fixture(scope="session")
def target() -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.from_pretrained(FIXTURE / "target", dtype=torch.float32).eval()
