"""Per-position confidence temperatures from Sequential Temperature Scaling (calibration.json)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

CALIBRATION_FILE = "calibration.json"


class Calibration(BaseModel):
    """c_k = sigmoid(logit_k / T_k), one T per block position."""

    model_config = ConfigDict(extra="forbid")

    drafter_id: str
    temperatures: list[float] = Field(min_length=1)

    def model_post_init(self, _context: object) -> None:
        if any(t <= 0 for t in self.temperatures):
            raise ValueError(f"calibration temperatures must be positive, got {self.temperatures}")

    @classmethod
    def find(cls, checkpoint_dir: str | Path, gamma: int) -> Calibration | None:
        """The calibration next to a checkpoint, or None; refuses one made for another block length."""
        path = Path(checkpoint_dir) / CALIBRATION_FILE
        if not path.is_file():
            return None
        calibration = cls.model_validate(json.loads(path.read_text()))
        if len(calibration.temperatures) != gamma:
            raise ValueError(
                f"{path} has {len(calibration.temperatures)} temperatures but the drafter drafts {gamma} tokens"
            )
        return calibration

    def save(self, checkpoint_dir: str | Path) -> None:
        (Path(checkpoint_dir) / CALIBRATION_FILE).write_text(self.model_dump_json(indent=2) + "\n")
