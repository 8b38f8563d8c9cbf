"""Build a verify-length policy from its command-line spelling."""

from __future__ import annotations

from dspark.policies.base import VerifyPolicy
from dspark.policies.static import StaticPolicy

POLICY_HELP = "none | static:K | full"


def build_policy(spec: str) -> VerifyPolicy:
    name, _, arg = spec.partition(":")
    if name == "none" and not arg:
        return StaticPolicy(0)
    if name == "full" and not arg:
        return StaticPolicy(None)
    if name == "static":
        try:
            return StaticPolicy(int(arg))
        except ValueError:
            raise ValueError(f"policy 'static:K' needs an integer K >= 0, got {spec!r}") from None
    raise ValueError(f"unknown verify policy {spec!r}; expected one of: {POLICY_HELP}")
