"""Operator-wide settings, read once from the environment (the chart sets them)."""

from __future__ import annotations

import os

from pydantic import BaseModel, Field


class OperatorConfig(BaseModel):
    node_label: str = Field("nvidia.com/gpu.product", min_length=1)
    reconcile_seconds: float = Field(15.0, gt=0)
    autoscale_tick_seconds: float = Field(5.0, gt=0)
    prometheus_url: str = ""
    prometheus_window: str = "2m"
    metrics_port: int = Field(8080, ge=0, le=65535)
    default_accepted_per_step: float = Field(2.0, gt=0)
    default_verify_tokens: float = Field(4.0, gt=0)
    profile_timeout_grace_seconds: float = Field(120.0, ge=0)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> OperatorConfig:
        """Fields from DSPARK_OPERATOR_<FIELD> variables, e.g. DSPARK_OPERATOR_NODE_LABEL."""
        environ = dict(os.environ if environ is None else environ)
        values = {
            name: environ[f"DSPARK_OPERATOR_{name.upper()}"]
            for name in cls.model_fields
            if f"DSPARK_OPERATOR_{name.upper()}" in environ
        }
        return cls.model_validate(values)
