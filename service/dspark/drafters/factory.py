"""`load_drafter`: build an engine drafter from a spec string."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dspark.drafters.base import Drafter
from dspark.drafters.calibration import Calibration
from dspark.drafters.checkpoint import SharedWeights, load_draft_model
from dspark.drafters.dspark_drafter import DSparkDrafter
from dspark.drafters.dspark_model import DSparkModel
from dspark.drafters.eagle3_drafter import Eagle3Drafter


def load_drafter(
    spec: str,
    target_config: Any,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    shared: SharedWeights | None = None,
    gamma: int | None = None,
) -> Drafter:
    """A drafter for `spec`; today a checkpoint directory (DSpark, DFlash or EAGLE-3, told apart by
    its config.json). `target_config` is checked against the checkpoint; `shared` passes the target's
    embedding / LM head (required when the checkpoint omits them, and shared instead of copied)."""
    # Named drafters ("none", "ngram", shipped defaults) resolve here, before the path lookup.
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"unknown drafter {spec!r}: not a checkpoint directory with config.json")
    model = load_draft_model(
        path, target=target_config, shared=shared, device=device, dtype=dtype, gamma=gamma
    )
    if isinstance(model, DSparkModel):
        return DSparkDrafter(model, Calibration.find(path, model.config.gamma))
    return Eagle3Drafter(model)
