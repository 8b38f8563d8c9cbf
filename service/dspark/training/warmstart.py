"""Where a run without a checkpoint starts: a trained drafter (the shipped one by default) or nothing.

A warm start takes every trained tensor of the source checkpoint and its drafting vocabulary; the
target's shared weights (embedding, frozen LM head) always come from the target. A source whose
shapes differ from the configured drafter is an error when asked for by name, and is left out
(with a warning) under `auto`, which only means "the shipped drafter when it fits".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from dspark.drafters.draft_vocab import token_ids
from torch import nn

log = logging.getLogger(__name__)


@dataclass
class WarmStart:
    source: Path
    state: dict[str, torch.Tensor]  # the checkpoint's tensors, the target's shared ones left out
    draft_vocab: torch.Tensor | None  # sorted target ids of its drafting vocabulary
    required: bool  # named explicitly (an error when it does not fit) rather than `auto`


def find_warm_start(setting: str | Path, kind: str, target_config: dict) -> WarmStart | None:
    """The checkpoint `setting` names for a drafter of `kind` on this target, read; None = fresh."""
    from dspark.drafters.checkpoint import read_state_dict
    from dspark.drafters.shipped import shipped_drafter

    if str(setting) == "none":
        return None
    if str(setting) in ("auto", "shipped"):
        try:
            source = shipped_drafter(kind, target_config)
        except ValueError:
            if str(setting) == "shipped":
                raise
            return None
    else:
        source = Path(setting)
        if not (source / "config.json").is_file():
            raise ValueError(f"warm_start: {source} is not a drafter checkpoint (no config.json)")
    state = read_state_dict(source)
    vocab = token_ids(state["d2t"]) if "d2t" in state else None
    return WarmStart(source, state, vocab, required=str(setting) != "auto")


def mismatch(model: nn.Module, warm: WarmStart) -> str | None:
    """Why `warm` cannot initialise `model` (missing / extra / differently shaped tensors), or None."""
    own = model.state_dict()
    shared = set(getattr(model, "shared_keys", ()))
    trainable = {k for k, p in model.named_parameters() if p.requires_grad}
    missing = sorted(trainable - warm.state.keys())
    extra = sorted(k for k in warm.state if k not in own and k not in shared)
    shapes = sorted(
        k for k in warm.state if k in own and k not in shared and warm.state[k].shape != own[k].shape
    )
    problems = [
        f"{label} {names[:4]}"
        for label, names in (("lacks", missing), ("has extra", extra), ("shapes differ in", shapes))
        if names
    ]
    return f"{warm.source} {'; '.join(problems)}" if problems else None


def apply_warm_start(model: nn.Module, warm: WarmStart) -> None:
    """Copy the checkpoint's tensors (not the target's shared ones) into `model`."""
    own = model.state_dict()
    shared = set(getattr(model, "shared_keys", ()))
    with torch.no_grad():
        for key, value in warm.state.items():
            if key in own and key not in shared:
                own[key].copy_(value.to(own[key].dtype))
    log.info("warm start from %s", warm.source)
