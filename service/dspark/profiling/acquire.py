"""Find this engine's SPS profile, or measure one: reused across starts on the same hardware."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sys
from pathlib import Path

from dspark.models.compiled_forward import forward_kind
from dspark.models.registry import dspark_home
from dspark.profiling.device import current_device_name
from dspark.sps_format import ProfileError, SpsProfile

log = logging.getLogger(__name__)

# A profile in seconds for an engine that serves at once: one batch size per doubling, two forwards
# each, over a shorter cached context (filling every slot with it is the largest part of the time).
QUICK_PROFILE = {"points_per_octave": 1, "repeats": 2, "min_seconds": 0.0, "context_len": 128}


def engine_identity(engine) -> tuple[str, str, str, str]:
    """(model, dtype, device, forward) as a profile records them."""
    dtype = str(engine.dtype).removeprefix("torch.")
    return engine.model_name, dtype, current_device_name(), forward_kind(engine.runner.forward)


def acquire_profile(
    engine, path: str | Path | None = None, strict: bool = False, quick: bool = False
) -> SpsProfile:
    """Load the profile at `path` (or $DSPARK_SPS_PROFILE, or the cache) if it belongs to this
    engine; otherwise say why, then profile now and cache the result (strict: refuse instead).

    `quick` (an engine serving at once): from the cache, the profile of the forward the engine will
    switch to is taken first, and a missing one is measured on `QUICK_GRID` in seconds rather than on
    the full grid; the policy's `OnlineSps` refines either from the engine's own steps.
    """
    model, dtype, device, forward = engine_identity(engine)
    kinds = [forward]
    if quick and (planned := _planned_forward(engine)) != forward:
        kinds.insert(0, planned)
    given = path or os.environ.get("DSPARK_SPS_PROFILE")
    cached = default_profile_path(model, dtype, device, forward)
    sources = (
        [(Path(given), forward)]
        if given
        else [(default_profile_path(model, dtype, device, k), k) for k in kinds]
    )
    for source, kind in sources:
        try:
            profile = SpsProfile.load(source)
            profile.ensure_matches(model, dtype, device, kind)
            profile.ensure_covers(engine.config.max_batch_tokens)
            log.info(
                "using SPS profile %s (%d points, measured %s)", source, len(profile.points), profile.created
            )
            return profile
        except ProfileError as e:
            if strict:
                raise
            if given or source.exists():
                log.warning("%s; profiling this engine instead", e)
    if not any(source.exists() for source, _ in sources):
        log.info(
            "no SPS profile for %s / %s / %s / %s forward yet; profiling this engine (once%s)",
            model,
            dtype,
            device,
            forward,
            ", a few seconds" if quick else "",
        )
    options = QUICK_PROFILE if quick else {}
    profile = profile_with_progress(engine, **options)
    profile.save(cached)
    log.info("saved SPS profile %s", cached)
    return profile


def _planned_forward(engine) -> str:
    """The forward an engine building its compiled forward in the background will step with."""
    background = getattr(engine, "background", None)
    return (
        "compiled" if background is not None and background.compile else forward_kind(engine.runner.forward)
    )


def profile_with_progress(engine, **options) -> SpsProfile:
    """`profile_engine(engine, **options)` with a progress bar on stderr, a tick per timed forward."""
    from tqdm import tqdm

    from dspark.profiling.profiler import profile_engine

    with tqdm(desc="profiling SPS(B)", unit="forward", file=sys.stderr) as bar:

        def step(b: int, sps: float) -> None:
            bar.set_postfix(B=b, sps=f"{sps:.1f}", refresh=False)
            bar.update(1)

        return profile_engine(engine, progress=step, **options)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def default_profile_path(model: str, dtype: str, device: str, forward: str = "eager") -> Path:
    """`$DSPARK_HOME/profiles/<slug>.json` (DSPARK_HOME defaults to ~/.cache/dspark).

    The slug is readable (model basename, dtype, device, and "compiled" for a compiled forward)
    plus a short hash of the exact identity, so two models with the same file name in different
    folders never share a profile.
    """
    identity = f"{model}\0{dtype}\0{device}" + ("" if forward == "eager" else f"\0{forward}")
    digest = hashlib.sha256(identity.encode()).hexdigest()[:8]
    name = _slug(Path(model.rstrip("/")).name or model)[:60] or "model"
    kind = "" if forward == "eager" else f"__{forward}"
    return dspark_home() / "profiles" / f"{name}__{_slug(dtype)}__{_slug(device)[:40]}{kind}__{digest}.json"
