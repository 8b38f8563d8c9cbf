"""Build a drafter from its command-line spelling."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from dspark.drafters.base import Drafter
from dspark.drafters.ngram import NgramDrafter, NoDrafter

DRAFTER_HELP = "none | ngram | a drafter checkpoint directory"


def load_drafter(
    spec: str, target_config: PretrainedConfig, gamma: int, device: torch.device, dtype: torch.dtype
) -> Drafter:
    if spec == "none":
        return NoDrafter()
    if spec == "ngram":
        return NgramDrafter(gamma, device=device)
    raise ValueError(f"unknown drafter {spec!r}; expected one of: {DRAFTER_HELP}")
