"""An engine over the tiny DeepSpec fixture target (no tokenizer: prompts are token ids)."""

from __future__ import annotations

import shutil
from pathlib import Path

from dspark.drafters.ngram import NoDrafter

from tests.drafters.helpers import FIXTURE, sequence
from tests.engine.helpers import engine_on


def fixture_engine():
    return engine_on(FIXTURE / "target", NoDrafter(), "none", max_num_seqs=1, max_model_len=16)


def fixture_prompts(
    domains=("math", "code"), per_domain: int = 3, length: int = 12
) -> dict[str, list[list[int]]]:
    return {d: [sequence(length, seed=100 * j + i) for i in range(per_domain)] for j, d in enumerate(domains)}


def copy_drafter(variant: str, dest: Path) -> Path:
    """A fixture checkpoint without its reference-output file (config + weights only)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(FIXTURE / f"draft_{variant}" / name, dest / name)
    return dest
