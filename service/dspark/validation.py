"""One-line messages from pydantic validation errors, for CLI errors, logs and HTTP 400s."""

from __future__ import annotations

from pydantic import ValidationError


def describe(error: ValidationError, top: str = "(top level)") -> str:
    """'field.path: message; ...', without pydantic's 'Value error, ' prefix and documentation links."""
    return "; ".join(
        f"{'.'.join(map(str, err['loc'])) or top}: {err['msg'].removeprefix('Value error, ')}"
        for err in error.errors()
    )
