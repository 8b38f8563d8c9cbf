"""The SPS profile `dspark profile` writes: steps per second as a function of verify batch tokens."""

from __future__ import annotations

import bisect
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

PROFILE_BEGIN = "----- DSPARK PROFILE BEGIN -----"
PROFILE_END = "----- DSPARK PROFILE END -----"


class SpsPoint(BaseModel):
    model_config = ConfigDict(frozen=True)

    batch_tokens: int = Field(ge=1)
    steps_per_second: float = Field(gt=0)


class SpsProfile(BaseModel):
    """One node type's measured curve; `sps(b)` interpolates it piecewise-linearly."""

    model_config = ConfigDict(frozen=True, extra="allow")

    version: int = 1
    device: str = ""
    node_type: str = ""
    model: str = ""
    dtype: str = ""
    engine: dict[str, Any] = Field(default_factory=dict)
    created: str = ""
    points: tuple[SpsPoint, ...] = Field(min_length=1)

    @field_validator("points")
    @classmethod
    def _sorted_unique(cls, points: tuple[SpsPoint, ...]) -> tuple[SpsPoint, ...]:
        ordered = tuple(sorted(points, key=lambda p: p.batch_tokens))
        batches = [p.batch_tokens for p in ordered]
        if len(batches) != len(set(batches)):
            raise ValueError(f"duplicate batch_tokens in profile points: {batches}")
        return ordered

    def sps(self, batch_tokens: float) -> float:
        """Steps per second at `batch_tokens`; flat below the first point, extrapolated as
        constant work per second (sps * b fixed) beyond the last, since past saturation the
        GPU's token throughput no longer grows."""
        xs = [p.batch_tokens for p in self.points]
        ys = [p.steps_per_second for p in self.points]
        if batch_tokens <= xs[0]:
            return ys[0]
        if batch_tokens >= xs[-1]:
            return ys[-1] * xs[-1] / batch_tokens
        i = bisect.bisect_right(xs, batch_tokens)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (batch_tokens - x0) / (x1 - x0)

    def summary(self) -> dict[str, Any]:
        """A few numbers for the service status: the curve's range and where it halves."""
        first, last = self.points[0], self.points[-1]
        half = next(
            (p.batch_tokens for p in self.points if p.steps_per_second <= first.steps_per_second / 2), None
        )
        return {
            "device": self.device,
            "points": len(self.points),
            "maxBatchTokens": last.batch_tokens,
            "spsAtMinBatch": round(first.steps_per_second, 3),
            "spsAtMaxBatch": round(last.steps_per_second, 3),
            "halfSpsBatchTokens": half,
        }

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)


def extract_profile_from_log(log: str) -> SpsProfile:
    """Parse the profile JSON a profiling pod printed between the BEGIN/END marker lines.

    The markers let the job's stdout also carry progress output; the last marked block wins.
    """
    lines = log.splitlines()
    try:
        end = len(lines) - 1 - lines[::-1].index(PROFILE_END)
        begin = end - 1 - lines[:end][::-1].index(PROFILE_BEGIN)
    except ValueError:
        raise ValueError("profiling pod log has no profile block between the marker lines") from None
    return SpsProfile.model_validate_json("\n".join(lines[begin + 1 : end]))
