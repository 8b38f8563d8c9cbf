"""Build a verify-length policy from its command-line spelling."""

from __future__ import annotations

from dspark.engine.config import AUTO
from dspark.engine.drafter import Drafter
from dspark.engine.policy_spec import PolicyName, PolicySettings, parse_policy
from dspark.engine.verify_policy import VerifyPolicy
from dspark.policies.baselines import StaticPolicy, ThresholdPolicy
from dspark.policies.dspark import dspark_policy
from dspark.policies.sps_curve import OnlineSps
from dspark.sps_format import SpsProfile

FALLBACK_POLICY = f"{PolicyName.STATIC}:4"  # `auto` for a drafter without confidences
AUTO_POLICY_HELP = f"auto ({PolicyName.DSPARK} for a drafter with a confidence head, else {FALLBACK_POLICY})"


def resolve_policy_spec(spec: str, drafter: Drafter) -> str:
    """`auto` becomes `dspark` for a drafter with a confidence head, `none` without a drafter, else
    `static:4`; any other spelling stays, unless it verifies drafts a drafterless engine never has."""
    if spec.strip() == AUTO:
        if drafter.gives_confidences:
            return PolicyName.DSPARK
        return FALLBACK_POLICY if drafter.gamma > 0 else PolicyName.NONE
    if drafter.gamma == 0 and parse_policy(spec)[0] != PolicyName.NONE:
        raise ValueError(
            f"policy '{spec}' chooses how many draft tokens to verify, but drafter "
            f"'{drafter.name}' drafts none; use policy 'none' (or 'auto'), or choose a drafter"
        )
    return spec


def build_policy(
    spec: str, sps: SpsProfile | OnlineSps | None = None, settings: PolicySettings = PolicySettings()
) -> VerifyPolicy:
    """`sps` is the engine's step-rate profile, which `dspark` and `dspark-async` need and wrap in
    `OnlineSps` so the engine's step timings refine it."""
    name, arg = parse_policy(spec)
    if name in (PolicyName.NONE, PolicyName.FULL, PolicyName.STATIC):
        return StaticPolicy({PolicyName.NONE: 0, PolicyName.FULL: None}.get(name, arg))
    if name == PolicyName.THRESHOLD:
        return ThresholdPolicy(arg)
    if sps is None:
        raise ValueError(
            f"policy '{name}' needs an SPS profile of this engine (steps per second against batch "
            "tokens); profile the engine first or choose a policy that needs none"
        )
    sps = OnlineSps(sps, settings) if isinstance(sps, SpsProfile) else sps
    return dspark_policy(sps, settings, asynchronous=name == PolicyName.DSPARK_ASYNC)
