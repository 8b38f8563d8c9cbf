"""Per-position confidence temperatures (and logit offsets) from Sequential Temperature Scaling
(calibration.json)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

CALIBRATION_FILE = "calibration.json"
# What identifies a checkpoint: its config and weights (the calibration itself is not part of it).
_ID_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def drafter_id(checkpoint_dir: str | Path) -> str:
    """A hash of the checkpoint's config and weight files (sharded ones too): a calibration fitted on
    one drafter is refused by any other, including a retrained one of the same shape."""
    root = Path(checkpoint_dir)
    names = [n for n in _ID_FILES if (root / n).is_file()]
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names += sorted(set(json.loads(index.read_text())["weight_map"].values()))
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode() + b"\0")
        with open(root / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()[:20]


class Calibration(BaseModel):
    """c_k = sigmoid(logit_k / T_k + b_k), one T (and b, 0 when absent) per block position.

    `temperatures` / `offsets` are fitted on sampled rounds and serve every request with a
    sampling temperature above 0; `greedy_temperatures` / `greedy_offsets`, when present, are
    fitted on greedy rounds (a greedy draft token survives only as the target's argmax, so the
    same head is calibrated differently there) and serve temperature-0 requests.
    """

    model_config = ConfigDict(extra="forbid")

    drafter_id: str
    temperatures: list[float] = Field(min_length=1)
    offsets: list[float] | None = None
    greedy_temperatures: list[float] | None = None
    greedy_offsets: list[float] | None = None

    def model_post_init(self, _context: object) -> None:
        for name, temperatures, offsets in (
            ("", self.temperatures, self.offsets),
            ("greedy ", self.greedy_temperatures, self.greedy_offsets),
        ):
            if temperatures is None:
                if offsets is not None:
                    raise ValueError(f"calibration {name}offsets need {name}temperatures")
                continue
            if len(temperatures) != len(self.temperatures) or not all(
                math.isfinite(t) and t > 0 for t in temperatures
            ):
                raise ValueError(
                    f"calibration {name}temperatures must be positive and finite, one per position, "
                    f"got {temperatures}"
                )
            if offsets is not None and (
                len(offsets) != len(temperatures) or not all(math.isfinite(b) for b in offsets)
            ):
                raise ValueError(f"calibration {name}offsets must be finite, one per temperature")

    def for_temperature(self, temperature: float) -> tuple[list[float], list[float] | None]:
        """The (temperatures, offsets) that serve requests sampled at `temperature`."""
        if temperature == 0 and self.greedy_temperatures is not None:
            return self.greedy_temperatures, self.greedy_offsets
        return self.temperatures, self.offsets

    @classmethod
    def find(cls, checkpoint_dir: str | Path, gamma: int) -> Calibration | None:
        """The calibration next to a checkpoint, or None; refuses one made for another drafter (its
        `drafter_id` differs from this checkpoint's) or for another block length."""
        path = Path(checkpoint_dir) / CALIBRATION_FILE
        if not path.is_file():
            return None
        calibration = cls.model_validate(json.loads(path.read_text()))
        expected = drafter_id(checkpoint_dir)
        if calibration.drafter_id != expected:
            raise ValueError(
                f"{path} was fitted for drafter {calibration.drafter_id}, but this checkpoint is {expected}: "
                "recalibrate it (`dspark calibrate`) or remove the file"
            )
        if len(calibration.temperatures) != gamma:
            raise ValueError(
                f"{path} has {len(calibration.temperatures)} temperatures but the drafter drafts {gamma} tokens"
            )
        return calibration

    def save(self, checkpoint_dir: str | Path) -> None:
        (Path(checkpoint_dir) / CALIBRATION_FILE).write_text(self.model_dump_json(indent=2) + "\n")
