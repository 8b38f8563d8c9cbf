"""The SLA tier format: a tier's interactivity targets and replica bounds, as the DSparkService CRD,
the chart's example tiers and the load tests' tier files spell them. The operator's `TierSpec` and
the load tests' `Tier` extend it with what only they need. Pydantic only (the operator image has no
torch nor NumPy)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

TIER_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,18}[a-z0-9])?$"  # a DNS label short enough for child names


class SlaTier(BaseModel):
    """Targets per user (p50 decode speed, p95 time to first token), replica bounds and priority."""

    model_config = ConfigDict(populate_by_name=True, frozen=True)

    name: str = Field(pattern=TIER_NAME_PATTERN)
    tokens_per_second_per_user: float = Field(alias="tokensPerSecondPerUser", gt=0)  # p50 target
    ttft_p95_seconds: float = Field(alias="ttftP95Seconds", gt=0)
    min_replicas: int = Field(1, alias="minReplicas", ge=0)
    max_replicas: int = Field(4, alias="maxReplicas", ge=1)
    priority: int = 0  # served first when a replica budget binds

    @model_validator(mode="after")
    def _bounds_ordered(self) -> SlaTier:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"tier {self.name!r}: minReplicas {self.min_replicas} > maxReplicas {self.max_replicas}"
            )
        return self


# The spellings of the fields every tier format shares, the name aside.
SHARED_FIELDS = tuple(field.alias or key for key, field in SlaTier.model_fields.items() if key != "name")
