"""Build a verify-length policy from its command-line spelling."""

from __future__ import annotations

from dspark.engine.config import AUTO
from dspark.engine.drafter import Drafter
from dspark.engine.policy_spec import PolicySettings, parse_policy
from dspark.engine.verify_policy import VerifyPolicy
from dspark.policies.dspark import DSparkAsyncPolicy, DSparkPolicy
from dspark.policies.sps_curve import OnlineSps
from dspark.policies.static import StaticPolicy
from dspark.policies.threshold import ThresholdPolicy
from dspark.sps_format import SpsProfile

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


def build_policy(
    spec: str, sps: SpsProfile | OnlineSps | None = None, settings: PolicySettings | None = None
) -> VerifyPolicy:
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
    return (DSparkPolicy if name == "dspark" else DSparkAsyncPolicy)(sps, settings=settings)
