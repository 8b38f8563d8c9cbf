"""The spellings of verify-length policies, checked without building one (or loading a model)."""

from __future__ import annotations

import contextlib
import math
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class PolicyName(StrEnum):  # every verify-length policy's name, spelled here once
    NONE = "none"
    STATIC = "static"
    FULL = "full"
    THRESHOLD = "threshold"
    DSPARK = "dspark"
    DSPARK_ASYNC = "dspark-async"


PROFILED_POLICIES = (PolicyName.DSPARK, PolicyName.DSPARK_ASYNC)  # schedule against the SPS profile
# The policies that take an argument: its spelling, type, check, and what the check needs.
_ARGUMENTS = {
    PolicyName.STATIC: (":K", int, lambda k: k >= 0, "an integer K >= 0"),
    PolicyName.THRESHOLD: (":X", float, lambda x: math.isfinite(x) and 0 < x < 1, "a number 0 < X < 1"),
}
POLICY_HELP = " | ".join(name + _ARGUMENTS.get(name, ("",))[0] for name in PolicyName)


def parse_policy(spec: str) -> tuple[PolicyName, int | float | None]:
    """(name, argument) of a policy spelling, refused with the accepted spellings when malformed;
    needs no profile, so a command can check its policies before it loads a model."""
    text, _, arg = spec.strip().partition(":")
    name = PolicyName(text) if text in PolicyName._value2member_map_ else None
    if name in (PolicyName.NONE, PolicyName.FULL, *PROFILED_POLICIES) and not arg:
        return name, None
    if name not in _ARGUMENTS:
        raise ValueError(f"unknown verify policy {spec!r}; expected one of: {POLICY_HELP}")
    spelling, kind, valid, needs = _ARGUMENTS[name]
    with contextlib.suppress(ValueError):
        if valid(value := kind(arg)):
            return name, value
    raise ValueError(f"policy '{name}{spelling}' needs {needs}, got {spec!r}")


def needs_profile(spec: str) -> bool:
    """Whether the policy spelled `spec` needs this engine's SPS profile."""
    return spec.strip() in PROFILED_POLICIES


class PolicySettings(BaseModel):
    """Tuning constants of the DSpark policies (`dspark`, `dspark-async`); the defaults are the
    measured ones (docs/scheduler.md). Carried by `EngineConfig.policy_settings`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The drafting gate.
    min_gain: float = Field(0.01, ge=0)  # drafting must promise this much more than plain decoding
    memory_rows: int = Field(64, ge=1)  # confidence rows of recent drafted steps the gate judges by
    judge_steps: int = Field(8, ge=1)  # drafted steps after which it judges on fewer rows than that
    explore_every: int = Field(32, ge=1)  # skipped steps in a row per burst step before drafting anyway
    reuse_steps: int = Field(4, ge=1)  # evaluations a horizon's expected rate is reused for
    draft_cost_alpha: float = Field(0.2, gt=0, le=1)  # EWMA rate of measured drafting times
    overhead_alpha: float = Field(0.1, gt=0, le=1)  # same, a step's time outside forward and drafting
    # The live acceptance scale.
    acceptance_decay: float = Field(0.999, gt=0, le=1)  # forgetting per request round that verified
    acceptance_prior_tokens: float = Field(5.0, ge=0)  # prior tokens at observed / predicted = 1
    # Online refinement of the SPS profile.
    sps_alpha: float = Field(0.01, gt=0, le=1)  # slowest rate of the per-size corrections
    sps_prior_weight: float = Field(4.0, ge=0)  # observations the profile counts as, per grid point
    sps_max_jump: float = Field(2.0, gt=1)  # largest factor one observation moves drift or a correction
    sps_refresh_every: int = Field(8, ge=1)  # observations between rebuilds of the lookup table
    sps_drift_alpha: float = Field(0.1, ge=0, le=1)  # EWMA rate of the drift shared by every size
