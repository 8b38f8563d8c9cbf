"""Build a verify-length policy from its command-line spelling."""

from __future__ import annotations

import math

from dspark.drafters.base import Drafter
from dspark.engine.config import AUTO
from dspark.policies.base import VerifyPolicy
from dspark.policies.dspark import DSparkAsyncPolicy, DSparkPolicy
from dspark.policies.static import StaticPolicy
from dspark.policies.threshold import ThresholdPolicy
from dspark.profiling.online import OnlineSps
from dspark.profiling.sps_profile import SpsProfile

POLICY_HELP = "none | static:K | full | threshold:X (0<X<1) | dspark | dspark-async"
# `auto` for a drafter without confidences (n-gram lookup, DFlash, EAGLE-3).
FALLBACK_POLICY = "static:4"
AUTO_POLICY_HELP = f"auto (dspark for a drafter with a confidence head, else {FALLBACK_POLICY})"


def resolve_policy_spec(spec: str, drafter: Drafter) -> str:
    """`auto` becomes `dspark` for a drafter with a confidence head, `none` without a drafter, else
    `static:4`; every other spelling is returned as it is."""
    if spec.strip() != AUTO:
        return spec
    if drafter.gives_confidences:
        return "dspark"
    return FALLBACK_POLICY if drafter.gamma > 0 else "none"


def parse_policy(spec: str) -> tuple[str, int | float | None]:
    """(name, argument) of a policy spelling, refused with the accepted spellings when malformed;
    needs no profile, so a command can check its policies before it loads a model."""
    name, _, arg = spec.strip().partition(":")
    if name in ("none", "full", "dspark", "dspark-async") and not arg:
        return name, None
    if name == "static":
        try:
            k = int(arg)
        except ValueError:
            k = -1
        if k < 0:
            raise ValueError(f"policy 'static:K' needs an integer K >= 0, got {spec!r}")
        return name, k
    if name == "threshold":
        try:
            x = float(arg)
        except ValueError:
            x = math.nan
        if not (math.isfinite(x) and 0 < x < 1):
            raise ValueError(f"policy 'threshold:X' needs a number 0 < X < 1, got {spec!r}")
        return name, x
    raise ValueError(f"unknown verify policy {spec!r}; expected one of: {POLICY_HELP}")


def build_policy(spec: str, sps: SpsProfile | OnlineSps | None = None) -> VerifyPolicy:
    """`sps` is the engine's step-rate profile; required by `dspark` and `dspark-async`, which
    wrap a plain profile in `OnlineSps` so the engine's step timings refine it."""
    name, arg = parse_policy(spec)
    if name in ("none", "full", "static"):
        return StaticPolicy({"none": 0, "full": None}.get(name, arg))
    if name == "threshold":
        return ThresholdPolicy(arg)
    if sps is None:
        raise ValueError(
            f"policy {name!r} needs an SPS profile of this engine (steps per second against batch "
            "tokens); profile the engine first or choose a policy that needs none"
        )
    return DSparkPolicy(sps) if name == "dspark" else DSparkAsyncPolicy(sps)
