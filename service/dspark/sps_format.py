"""The SPS profile format: verification steps per second of an engine against the tokens in the forward.

JSON layout (version 1), written by `dspark profile` and read by the engine's policies and the
operator:

    {"version": 1, "device": "NVIDIA H200", "node_type": "gpu-h200", "model": "Qwen3-4B",
     "dtype": "bfloat16", "engine": {"max_batch_tokens": 2048, ...},
     "created": "2026-11-29T07:38:14+00:00",
     "points": [{"batch_tokens": 1, "steps_per_second": 61.2}, ...]}

A measured curve is jagged (kernel tiles, CUDA-graph buckets) and is kept as measured; the
points are only sorted by batch size. `SpsProfile.sps` defines the curve between and beyond the
points, for a number in pure Python and for a NumPy array or a torch tensor. This module imports
neither torch nor NumPy (the operator image has neither); the array and tensor lookups import
them when called.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from dspark.validation import describe

if TYPE_CHECKING:
    import numpy as np
    import torch

# A profiling Job prints the profile between these lines; the operator reads it from the pod log.
PROFILE_BEGIN = "----- DSPARK PROFILE BEGIN -----"
PROFILE_END = "----- DSPARK PROFILE END -----"

Dtype = Literal["bfloat16", "float32"]


class ProfileError(ValueError):
    """An SPS profile is missing, malformed, or belongs to another model, dtype or device."""


def sps_of_array_or_float(sps: Callable[[torch.Tensor], torch.Tensor], batch_tokens: np.ndarray | float):
    """`sps` on a NumPy array (an array back) or a number (a float back)."""
    import numpy as np
    import torch

    if isinstance(batch_tokens, np.ndarray):
        return sps(torch.from_numpy(batch_tokens.astype(np.float64))).numpy()
    return float(sps(torch.tensor([float(batch_tokens)], dtype=torch.float64))[0])


class SpsPoint(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_tokens: int = Field(ge=1, strict=True)
    steps_per_second: float = Field(gt=0, allow_inf_nan=False)


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class SpsProfile(BaseModel):
    """A measured step-rate curve SPS(B) for one model, dtype and device."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1
    device: str = Field(min_length=1)
    node_type: str = ""
    model: str = Field(min_length=1)
    dtype: Dtype
    engine: dict[str, Any] = Field(default_factory=dict)
    created: str = Field(default_factory=_now_iso)
    points: list[SpsPoint] = Field(min_length=1)

    _source: str = PrivateAttr(default="<memory>")
    _tail_slope: float = PrivateAttr(default=0.0)
    _xp: torch.Tensor | None = PrivateAttr(default=None)
    _fp: torch.Tensor | None = PrivateAttr(default=None)
    _table: torch.Tensor | None = PrivateAttr(default=None)

    @field_validator("created")
    @classmethod
    def _iso8601(cls, value: str) -> str:
        try:
            datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(f"not an ISO 8601 timestamp: {value!r}") from None
        return value

    @field_validator("points")
    @classmethod
    def _sorted_unique(cls, points: list[SpsPoint]) -> list[SpsPoint]:
        points = sorted(points, key=lambda p: p.batch_tokens)
        dupes = sorted(
            {a.batch_tokens for a, b in itertools.pairwise(points) if a.batch_tokens == b.batch_tokens}
        )
        if dupes:
            raise ValueError(f"duplicate batch_tokens {dupes}: each batch size must be measured once")
        return points

    def model_post_init(self, context: Any) -> None:
        self._tail_slope = _tail_slope(
            [float(p.batch_tokens) for p in self.points], [1.0 / p.steps_per_second for p in self.points]
        )

    def __eq__(self, other: object) -> bool:
        # Same measurements and metadata; where it was loaded from and the lookup caches don't count.
        if not isinstance(other, SpsProfile):
            return NotImplemented
        return self.model_dump() == other.model_dump()

    __hash__ = None  # type: ignore[assignment]  # `engine` is a free dict

    # -- loading and saving -------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SpsProfile:
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ProfileError(f"SPS profile not found: {path}") from None
        except OSError as exc:
            raise ProfileError(f"cannot read SPS profile {path}: {exc}") from None
        return cls.parse(text, source=str(path))

    @classmethod
    def parse(cls, text: str, source: str = "<string>") -> SpsProfile:
        if not text.strip():
            raise ProfileError(f"SPS profile {source} is empty")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"SPS profile {source} is not valid JSON: {exc}") from None
        try:
            profile = cls.model_validate(data)
        except ValidationError as exc:
            raise ProfileError(f"SPS profile {source} is invalid: {describe(exc)}") from None
        profile._source = source
        return profile

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the profile as JSON (atomically: a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(self.model_dump_json(indent=2) + "\n")
        tmp.replace(path)
        return path

    @property
    def source(self) -> str:
        """Where the profile was loaded from (for messages)."""
        return self._source

    # -- does it belong to this engine? --------------------------------------------------------

    def mismatches(self, model: str, dtype: str, device: str, forward: str = "eager") -> list[str]:
        """What differs from the engine. `forward` is "compiled" or "eager"; a profile that does not
        record it was measured eagerly."""
        found = []
        for what, mine, theirs in (
            ("model", self.model, model),
            ("dtype", self.dtype, dtype),
            ("device", self.device, device),
            ("forward", self.engine.get("forward", "eager"), forward),
        ):
            if mine != theirs:
                found.append(f"{what} {mine!r} (engine runs {theirs!r})")
        return found

    def matches(self, model: str, dtype: str, device: str, forward: str = "eager") -> bool:
        return not self.mismatches(model, dtype, device, forward)

    def ensure_matches(self, model: str, dtype: str, device: str, forward: str = "eager") -> None:
        """Refuse a profile measured for another model, dtype, device or forward: its step rates
        would mislead."""
        found = self.mismatches(model, dtype, device, forward)
        if found:
            raise ProfileError(
                f"refusing SPS profile {self.source}: it was measured for "
                + ", ".join(found)
                + "; profile this engine again or point to the matching profile"
            )

    def ensure_covers(self, max_batch_tokens: int) -> None:
        """Refuse a profile that stops short of the engine's largest forward: the rest would be a guess."""
        largest = self.points[-1].batch_tokens
        if largest < max_batch_tokens:
            raise ProfileError(
                f"refusing SPS profile {self.source}: it was measured up to {largest} batch tokens "
                f"but this engine runs forwards of up to {max_batch_tokens}"
            )

    # -- lookup --------------------------------------------------------------------------------

    @overload
    def sps(self, batch_tokens: torch.Tensor) -> torch.Tensor: ...
    @overload
    def sps(self, batch_tokens: np.ndarray) -> np.ndarray: ...
    @overload
    def sps(self, batch_tokens: float) -> float: ...

    def sps(self, batch_tokens: torch.Tensor | np.ndarray | float) -> torch.Tensor | np.ndarray | float:
        """Steps per second for a forward of `batch_tokens` tokens (float64 tensor for a tensor,
        array for an array).

        Linear between measured points, flat below the first. Beyond the last point the step
        time is assumed to keep growing linearly in B, with the steeper of the last segment's
        and the whole curve's time-per-token slopes (never negative; a one-point profile
        assumes time proportional to B), so extrapolated SPS never increases and errs low.
        """
        if not _is_tensor(batch_tokens):
            if _is_array(batch_tokens):
                return sps_of_array_or_float(self.sps, batch_tokens)
            return self._sps_of_number(float(batch_tokens))
        import torch

        if self._xp is None or self._fp is None:
            self._xp = torch.tensor(self.batch_tokens(), dtype=torch.float64)
            self._fp = torch.tensor(self.steps_per_second(), dtype=torch.float64)
        b = batch_tokens.to(torch.float64)
        inside = interp_flat(b, self._xp, self._fp)
        last_b, last_sps = float(self.points[-1].batch_tokens), self.points[-1].steps_per_second
        tail = 1.0 / (1.0 / last_sps + self._tail_slope * (b - last_b).clamp_min(0.0))
        return torch.where(b > last_b, tail, inside)

    def _sps_of_number(self, b: float) -> float:
        """`sps` for one batch size, in the tensor path's arithmetic."""
        xs, ys = self.batch_tokens(), self.steps_per_second()
        last_b, last_sps = float(xs[-1]), ys[-1]
        if b > last_b:
            return 1.0 / (1.0 / last_sps + self._tail_slope * (b - last_b))
        if len(xs) == 1 or b <= xs[0]:
            return ys[0]
        right = min(max(bisect.bisect_right(xs, b), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[right - 1], xs[right], ys[right - 1], ys[right]
        w = min(max((b - x0) / (x1 - x0), 0.0), 1.0)
        return y0 + w * (y1 - y0)

    def table(self, max_batch_tokens: int) -> torch.Tensor:
        """SPS at every integer B in [0, max_batch_tokens] (and maybe beyond), float64 on the CPU."""
        import torch

        if self._table is None or self._table.numel() <= max_batch_tokens:
            size = max(max_batch_tokens + 1, 2 * (0 if self._table is None else self._table.numel()), 64)
            self._table = self.sps(torch.arange(size, dtype=torch.float64))
        return self._table

    def batch_tokens(self) -> list[int]:
        return [p.batch_tokens for p in self.points]

    def steps_per_second(self) -> list[float]:
        return [p.steps_per_second for p in self.points]

    def summary(self) -> dict[str, Any]:
        """A few numbers for a status: the curve's range and where it halves."""
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
        """Compact JSON with sorted keys (stable across writes, for ConfigMaps)."""
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


def interp_flat(x: torch.Tensor, xp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    """Linear interpolation of (xp, fp) at x, constant beyond both ends; xp ascending, float64
    (torch has no `interp`). Returns float64 on x's device (xp and fp are moved there if needed)."""
    import torch

    x = x.to(torch.float64)
    xp = xp.to(x.device)
    fp = fp.to(x.device)
    if xp.numel() == 1:
        return fp.expand(x.shape).clone()
    right = torch.searchsorted(xp, x, right=True).clamp(1, xp.numel() - 1)
    left = right - 1
    x0, x1 = xp[left], xp[right]
    w = ((x - x0) / (x1 - x0)).clamp(0.0, 1.0)
    return fp[left] + w * (fp[right] - fp[left])


def _is_tensor(value: object) -> bool:
    torch = sys.modules.get("torch")  # not imported: cannot be a tensor
    return torch is not None and isinstance(value, torch.Tensor)


def _is_array(value: object) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


def _tail_slope(xs: list[float], times: list[float]) -> float:
    """Seconds per extra token beyond the last measured point (see `SpsProfile.sps`)."""
    if len(xs) == 1:
        return times[0] / xs[0]
    last = (times[-1] - times[-2]) / (xs[-1] - xs[-2])
    overall = (times[-1] - times[0]) / (xs[-1] - xs[0])
    slope = max(last, overall, 0.0)
    return slope if math.isfinite(slope) else 0.0
