"""SLA tiers: the interactivity targets a deployment must hold, and the load each is tested under.

The targets and replica bounds are the shared tier format (`dspark.tier_format.SlaTier`), which the
chart's `example.tiers` and the DSparkService CRD spell alike; the rest (the p10 speed target, the
workload and the load shape) belong to the load test only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from dspark.tier_format import SlaTier
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_TIERS_FILE = Path(__file__).resolve().parent / "tiers.yaml"  # loadtest/tiers.yaml links here
DOMAINS = ("math", "code", "chat")
MAX_DURATION_S = 3600.0  # every run stops by itself: no scenario may ask for more than an hour


class _Model(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=True)


class Workload(_Model):
    """What each simulated user sends."""

    api: Literal["chat", "completions", "mixed"] = "chat"  # mixed: each request picks one at random
    mix: dict[Literal["math", "code", "chat"], float] = Field(
        default_factory=lambda: {"math": 1.0, "code": 1.0, "chat": 1.0}
    )
    prompt_words: int = Field(0, alias="promptWords", ge=0, le=20000)
    max_tokens: int = Field(128, alias="maxTokens", ge=1, le=32768)
    ignore_eos: bool = Field(True, alias="ignoreEos")
    temperature: float = Field(0.0, ge=0.0, le=2.0)

    @model_validator(mode="after")
    def _mix_has_weight(self) -> Workload:
        if any(w < 0 for w in self.mix.values()) or sum(self.mix.values()) <= 0:
            raise ValueError(f"mix needs non-negative weights with a positive sum, got {self.mix}")
        return self


class ConstantLoad(_Model):
    """A fixed number of concurrent users for the whole run."""

    shape: Literal["constant"]
    users: int = Field(ge=1, le=10000)
    spawn_rate: float = Field(10.0, alias="spawnRate", gt=0)
    duration: float = Field(gt=0, le=MAX_DURATION_S)
    arrival_rate: float | None = Field(None, alias="arrivalRate", gt=0)  # requests/s over all users


class StepLoad(_Model):
    """Start with `startUsers`, add `stepUsers` every `stepSeconds` up to `maxUsers`."""

    shape: Literal["step"]
    start_users: int = Field(alias="startUsers", ge=1)
    step_users: int = Field(alias="stepUsers", ge=1)
    step_seconds: float = Field(alias="stepSeconds", gt=0)
    max_users: int = Field(alias="maxUsers", ge=1, le=10000)
    spawn_rate: float = Field(10.0, alias="spawnRate", gt=0)
    duration: float = Field(gt=0, le=MAX_DURATION_S)
    arrival_rate: float | None = Field(None, alias="arrivalRate", gt=0)


class SpikeLoad(_Model):
    """`baseUsers`, then `spikeUsers` from `spikeAt` for `spikeSeconds`, then back to base."""

    shape: Literal["spike"]
    base_users: int = Field(alias="baseUsers", ge=1)
    spike_users: int = Field(alias="spikeUsers", ge=1, le=10000)
    spike_at: float = Field(alias="spikeAt", ge=0)
    spike_seconds: float = Field(alias="spikeSeconds", gt=0)
    spawn_rate: float = Field(50.0, alias="spawnRate", gt=0)
    duration: float = Field(gt=0, le=MAX_DURATION_S)
    arrival_rate: float | None = Field(None, alias="arrivalRate", gt=0)


LoadShape = Annotated[ConstantLoad | StepLoad | SpikeLoad, Field(discriminator="shape")]


class Tier(SlaTier):
    """A tier's targets and replica bounds (shared with the operator and the chart), the p10 speed
    target, and the workload and load shape it is tested under."""

    model_config = ConfigDict(extra="forbid")

    tokens_per_second_per_user_p10: float | None = Field(None, alias="tokensPerSecondPerUserP10", gt=0)
    max_error_ratio: float = Field(0.01, alias="maxErrorRatio", ge=0, le=1)
    max_requests: int = Field(100000, alias="maxRequests", ge=1)  # hard cap beside the duration
    workload: Workload = Workload()
    load: LoadShape

    @model_validator(mode="after")
    def _p10_below_p50(self) -> Tier:
        p10 = self.tokens_per_second_per_user_p10
        if p10 is not None and p10 > self.tokens_per_second_per_user:
            raise ValueError(f"tier {self.name!r}: the p10 speed target {p10} exceeds the p50 target")
        return self


class TierFile(_Model):
    tiers: tuple[Tier, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> TierFile:
        names = [t.name for t in self.tiers]
        if len(names) != len(set(names)):
            raise ValueError(f"tier names must be unique, got {names}")
        return self

    def get(self, name: str) -> Tier:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(f"no tier {name!r}; known: {', '.join(t.name for t in self.tiers)}")


def load_tiers(path: str | Path = DEFAULT_TIERS_FILE) -> TierFile:
    """Read and validate a tier file; a bad file raises ValueError naming the file and the field."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read tier file {path}: {e}") from None
    try:
        return TierFile.model_validate(raw)
    except ValidationError as e:
        raise ValueError(f"invalid tier file {path}:\n{e}") from None
