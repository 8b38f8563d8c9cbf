"""When a replica is ready: its model is loaded and the verify policy has the inputs it needs."""

from __future__ import annotations

import os
from pathlib import Path

SPS_PROFILE_ENV = "DSPARK_SPS_PROFILE"
# Policies that schedule from a measured SPS(B) curve; the rest (none, static, full, threshold) need none.
_PROFILED_POLICIES = ("dspark", "dspark-async")


def policy_needs_profile(policy: str) -> bool:
    return policy.strip().partition(":")[0] in _PROFILED_POLICIES


def sps_profile_path(configured: Path | None, default: Path | None) -> Path | None:
    """The configured path, else $DSPARK_SPS_PROFILE, else the profiler's default for this engine."""
    if configured is not None:
        return Path(configured)
    env = os.environ.get(SPS_PROFILE_ENV)
    return Path(env) if env else default


def profile_present(policy: str, configured: Path | None = None, default: Path | None = None) -> bool:
    """True when the policy needs no SPS profile, or its profile file exists and parses."""
    if not policy_needs_profile(policy):
        return True
    path = sps_profile_path(configured, default)
    if path is None or not path.is_file():
        return False
    from dspark.profiling.sps_profile import SpsProfile

    try:
        SpsProfile.load(path)
    except Exception:  # any unreadable or invalid profile means "not ready", never a 500
        return False
    return True


def default_profile_for(engine) -> Path | None:
    """Where the profiler stores this engine's profile (model, dtype, device), if it can say."""
    try:
        from dspark.profiling.device import current_device_name
        from dspark.profiling.sps_profile import default_profile_path

        dtype = str(getattr(engine, "dtype", "")).removeprefix("torch.")
        return default_profile_path(engine.config.target, dtype, current_device_name())
    except Exception:
        return None
