"""Sampling defaults from a model's generation_config.json, applied as vLLM applies them.

vLLM's `--generation-config auto` (its default) takes these keys from the model's file and uses them
for every request that leaves the field out; `vllm` ignores the file; a directory reads its file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from dspark.models.pull import ModelError, resolve_target

log = logging.getLogger(__name__)

# generation_config.json key -> request field it gives the default of.
DEFAULTED_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(spec: str, target: str | None) -> dict[str, Any]:
    """Request-field defaults for `--generation-config spec` (auto | vllm | DIR) of `target` (None:
    an engine without a model directory, which has no file to read)."""
    if spec == "vllm" or (spec == "auto" and target is None):
        return {}
    directory = resolve_target(target, progress=False) if spec == "auto" else Path(spec).expanduser()
    file = directory / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {file}: {e}") from e
    defaults = {field: raw[key] for key, field in DEFAULTED_FIELDS.items() if raw.get(key) is not None}
    if defaults:
        log.info("sampling defaults from %s: %s", file, defaults)
    return defaults
