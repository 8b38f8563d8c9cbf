"""When a replica is ready: its model is loaded and the verify policy has the inputs it needs."""

from __future__ import annotations

import os
from pathlib import Path

SPS_PROFILE_ENV = "DSPARK_SPS_PROFILE"
# Policies that schedule from a measured SPS(B) curve; the others (none/static/full) need no profile.
_PROFILE_FREE_POLICIES = ("none", "static", "full")


def default_sps_profile_path() -> Path:
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark")) / "sps_profile.json"


def sps_profile_path(configured: Path | None = None) -> Path:
    if configured is not None:
        return Path(configured)
    env = os.environ.get(SPS_PROFILE_ENV)
    return Path(env) if env else default_sps_profile_path()


def policy_needs_profile(policy: str) -> bool:
    return policy.partition(":")[0] not in _PROFILE_FREE_POLICIES


def profile_present(policy: str, configured: Path | None = None) -> bool:
    """True when the policy needs no SPS profile or its profile file exists."""
    return not policy_needs_profile(policy) or sps_profile_path(configured).is_file()
