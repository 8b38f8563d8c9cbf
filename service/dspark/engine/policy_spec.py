"""The spellings of verify-length policies, checked without building one (or loading a model)."""

from __future__ import annotations

import math

POLICY_HELP = "none | static:K | full | threshold:X (0<X<1) | dspark | dspark-async"


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
