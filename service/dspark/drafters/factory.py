"""`load_drafter`: build an engine drafter from its command-line spelling."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dspark.drafters.shipped import SHIPPED_NAMES, available, shipped_drafter, shipped_target
from dspark.engine.config import AUTO
from dspark.engine.drafter import Drafter
from dspark.models.hub import DRAFTER_FILES, download, parse_hub_id
from dspark.models.packed_linear import can_pack, pack_linears

if TYPE_CHECKING:  # the checkpoint's modules import transformers' model code (seconds): only to load one
    from dspark.drafters.checkpoint import SharedWeights

DRAFTER_HELP = (
    "auto (the target's shipped DSpark drafter, else ngram) | none | ngram | "
    "dspark | dflash | eagle3 (the shipped drafters of the target) | "
    "a drafter checkpoint directory or hub id org/name[@revision] (DSpark, DFlash or EAGLE-3), "
    "optionally as KIND:<checkpoint> to refuse a checkpoint of another kind | "
    "ngram+<one of those> (n-gram lookup where the text repeats, the model elsewhere)"
)
LOOKUP_FIRST = "ngram+"
MODEL_KINDS = ("dspark", "dflash", "eagle3")


def split_kind(spec: str) -> tuple[str | None, str]:
    """`dflash:org/name` -> ("dflash", "org/name"); a spec without a kind prefix -> (None, spec)."""
    kind, sep, rest = spec.partition(":")
    return (kind, rest) if sep and rest and kind in MODEL_KINDS else (None, spec)


def resolve_drafter_spec(spec: str, target_config: Any) -> str:
    """`auto` becomes `dspark` when a DSpark drafter is shipped for this target, else `ngram`
    (which any target can use); every other spelling is returned as it is."""
    if spec.strip() != AUTO:
        return spec
    target = shipped_target(target_config)
    return "dspark" if target is not None and "dspark" in available(target) else "ngram"


def checkpoint_dir(spec: str) -> Path:
    """The directory of a drafter checkpoint given as a path or a hub id (downloaded on first use)."""
    path = Path(spec).expanduser()
    if not path.is_dir() and (hub := parse_hub_id(spec)) is not None:
        return download(hub, "drafter", DRAFTER_FILES)
    return path


def load_drafter(
    spec: str,
    target_config: Any,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    shared: SharedWeights | None = None,
    gamma: int | None = None,
    calibrated: bool = True,
) -> Drafter:
    """A drafter for `spec`. Checkpoints (told apart by their config.json) are checked against
    `target_config` and keep their own block size unless `gamma` overrides it; `shared` passes the target's embedding and
    LM head (required when the checkpoint omits them, and shared instead of copied). `calibrated=False`
    ignores calibration.json (raw confidences, as `dspark calibrate` needs them)."""
    from dspark.drafters.ngram import NgramDrafter, NoDrafter

    if spec == "none":
        return NoDrafter()
    if spec == "ngram":
        return NgramDrafter(gamma or 7, device=device)
    if spec.startswith(LOOKUP_FIRST):
        from dspark.drafters.lookup_first import LookupFirstDrafter

        rest = spec.removeprefix(LOOKUP_FIRST)
        if rest in ("none", "ngram") or rest.startswith(LOOKUP_FIRST):
            raise ValueError(f"drafter {spec!r}: after `ngram+` comes a model drafter, not {rest!r}")
        model = load_drafter(
            rest, target_config, device, dtype, shared=shared, gamma=gamma, calibrated=calibrated
        )
        return LookupFirstDrafter(model)
    want, spec = split_kind(spec)
    path = shipped_drafter(spec, target_config) if spec in SHIPPED_NAMES else checkpoint_dir(spec)
    if not (path / "config.json").is_file():
        raise ValueError(f"unknown drafter {spec!r}; expected one of: {DRAFTER_HELP}")
    if want is not None:
        require_kind(path, want, spec)

    from dspark.drafters.calibration import Calibration
    from dspark.drafters.checkpoint import load_draft_model
    from dspark.drafters.dspark_drafter import DSparkDrafter
    from dspark.drafters.dspark_model import DSparkModel
    from dspark.drafters.eagle3_drafter import Eagle3Drafter

    model = load_draft_model(
        path, target=target_config, shared=shared, device=device, dtype=dtype, gamma=gamma
    )
    if can_pack(torch.device(device), dtype):  # a serving drafter's weights never change
        pack_linears(model)
    if isinstance(model, DSparkModel):
        return DSparkDrafter(model, Calibration.find(path, model.config.gamma) if calibrated else None)
    return Eagle3Drafter(model)


def require_kind(path: Path, want: str, spec: str) -> None:
    """Refuse a checkpoint whose config.json declares another kind of drafter than `want`."""
    from dspark.drafters.config import checkpoint_kind

    raw = json.loads((path / "config.json").read_text())
    if (kind := checkpoint_kind(raw)) != want:
        archs = raw.get("architectures") or [raw.get("speculators_model_type")]
        raise ValueError(
            f"drafter {spec!r} is a {kind} checkpoint ({archs[0]}), not {want}; name method {kind!r} for it"
        )
