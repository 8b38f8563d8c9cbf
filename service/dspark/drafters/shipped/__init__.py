"""Trained drafters shipped in the package, one directory per target: `<target>/<kind>/`.

Each holds config.json + model.safetensors (bf16, without the target's embedding / LM head),
training.json (how it was trained) and, once calibrated, calibration.json. `shipped_drafter`
resolves a name (`dspark`, `dflash`, `eagle3`) for a target by its shape (vocabulary, hidden
size, layers), the same check a checkpoint must pass to load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHIPPED_ROOT = Path(__file__).parent
SHIPPED_NAMES = ("dspark", "dflash", "eagle3")

# target name -> (vocab_size, hidden_size, num_hidden_layers) of the model the drafters were trained on
SHIPPED_TARGETS: dict[str, tuple[int, int, int]] = {"smollm2-135m": (49152, 576, 30)}


def available(target_name: str) -> list[str]:
    root = SHIPPED_ROOT / target_name
    return [n for n in SHIPPED_NAMES if (root / n / "config.json").is_file()]


def _shape(target_config: Any) -> tuple[int, int, int]:
    from dspark.drafters.config import TargetShape

    shape = TargetShape.of(target_config)
    return shape.vocab_size, shape.hidden_size, shape.num_hidden_layers


def shipped_target(target_config: Any) -> str | None:
    """The shipped target this model has the shape of (vocabulary, hidden size, layers), if any."""
    key = _shape(target_config)
    return next((name for name, shape in SHIPPED_TARGETS.items() if shape == key), None)


def shipped_drafter(name: str, target_config: Any) -> Path:
    """Directory of the shipped drafter `name` for this target; a clear error when there is none."""
    target_name = shipped_target(target_config)
    if target_name is None:
        vocab, hidden, layers = _shape(target_config)
        shipped = {t: available(t) for t in SHIPPED_TARGETS}
        raise ValueError(
            f"no shipped drafters for this target (vocab {vocab}, hidden {hidden}, {layers} layers); "
            f"shipped drafters exist for: {shipped}. Train one with `dspark train` and pass its directory."
        )
    names = available(target_name)
    if name not in names:
        raise ValueError(
            f"no shipped {name!r} drafter for {target_name}; shipped for it: {', '.join(names) or 'none'}"
        )
    return SHIPPED_ROOT / target_name / name
