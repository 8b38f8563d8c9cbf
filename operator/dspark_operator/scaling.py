"""Pure autoscaling decisions: desired replicas of one tier from its metrics, profile and SLA.

Capacity model (deliberately simple, see docs/deploy-kubernetes.md):
  a replica serving n concurrent requests verifies B = n * v tokens per step, where v is the
  verify tokens per request per step (draft length + 1), and runs SPS(B) steps per second from
  the node type's profile; each request gains tau tokens per step (accepted drafts + 1), so the
  per-user speed is SPS(n * v) * tau. A replica's "slots" for a tier are the largest n whose
  speed still meets the tier's per-user target, times a utilization margin.

Decision rules, evaluated once per interval:
  * outside [minReplicas, maxReplicas] -> clamp at once;
  * SLA violated (per-user p50 below target or TTFT p95 above target by more than the tolerance)
    -> scale up to max(load model, current * measured/target ratio), at least +1;
  * the load model needs more replicas than running -> scale up to it;
  * SLA comfortably met (beyond the tolerance band) and the load model, with the band added,
    needs fewer -> scale down to the highest recommendation seen during the scale-down window;
  * every scale-up is capped at max(current + 1, current * maxScaleUpFactor) and waits the
    scale-up cool-down after the previous scaling; every scale-down waits the scale-down
    cool-down. A reversal of direction therefore happens at most once per scale-down cool-down.
  Reaching a recommendation R from current C takes ceil(log_f(R / C)) scale-ups (f the factor),
  one per scale-up cool-down.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from dspark.sps_format import SpsProfile

MAX_CONCURRENCY_SEARCH = 4096


@dataclass(frozen=True)
class CapacityModel:
    profile: SpsProfile
    accepted_per_step: float = 2.0  # tau: tokens each request gains per step
    verify_tokens_per_request: float = 4.0  # v: tokens each request adds to the verify batch per step

    def per_user_tokens_per_second(self, concurrency: float) -> float:
        batch = max(1.0, concurrency * self.verify_tokens_per_request)
        return self.profile.sps(batch) * self.accepted_per_step

    def max_concurrency(self, tokens_per_second: float) -> int:
        """Most concurrent requests one replica holds at >= `tokens_per_second` each (0: not even one)."""
        n = 0
        while n < MAX_CONCURRENCY_SEARCH and self.per_user_tokens_per_second(n + 1) >= tokens_per_second:
            n += 1
        return n

    def calibrated(
        self, accepted_per_step: float | None, verify_tokens_per_request: float | None
    ) -> CapacityModel:
        """The same profile with measured tau and v where the metrics provide them."""
        return replace(
            self,
            accepted_per_step=accepted_per_step
            if accepted_per_step and accepted_per_step > 0
            else self.accepted_per_step,
            verify_tokens_per_request=(
                verify_tokens_per_request
                if verify_tokens_per_request and verify_tokens_per_request > 0
                else self.verify_tokens_per_request
            ),
        )


@dataclass(frozen=True)
class TierTarget:
    tokens_per_second: float
    ttft_p95_seconds: float
    min_replicas: int
    max_replicas: int


@dataclass(frozen=True)
class TierMetrics:
    """One interval's view of a tier; None where the tier had no traffic to measure."""

    tokens_per_second_p50: float | None
    ttft_p95_seconds: float | None
    requests_running: float = 0.0
    requests_waiting: float = 0.0
    accepted_per_step: float | None = None
    verify_tokens_per_request: float | None = None

    @property
    def demand(self) -> float:
        return self.requests_running + self.requests_waiting


@dataclass(frozen=True)
class ScalingPolicy:
    tolerance: float = 0.1
    scale_up_cooldown_seconds: float = 60.0
    scale_down_cooldown_seconds: float = 300.0
    max_scale_up_factor: float = 2.0
    target_utilization: float = 0.9


@dataclass(frozen=True)
class ScalingMemory:
    """What a tier's decisions must remember between intervals (persisted in the service status)."""

    last_scale_time: float | None = None
    last_direction: int = 0
    recommendations: tuple[tuple[float, int], ...] = field(default_factory=tuple)

    def to_status(self) -> dict:
        return {
            "lastScaleTime": self.last_scale_time,
            "lastDirection": self.last_direction,
            "recommendations": [[t, r] for t, r in self.recommendations],
        }

    @classmethod
    def from_status(cls, status: Mapping | None) -> ScalingMemory:
        status = status or {}
        return cls(
            last_scale_time=status.get("lastScaleTime"),
            last_direction=int(status.get("lastDirection") or 0),
            recommendations=tuple((float(t), int(r)) for t, r in status.get("recommendations") or ()),
        )


@dataclass(frozen=True)
class Decision:
    current: int
    desired: int
    recommendation: int
    reason: str
    memory: ScalingMemory

    @property
    def direction(self) -> int:
        return (self.desired > self.current) - (self.desired < self.current)


def _clamp(value: int, target: TierTarget) -> int:
    return max(target.min_replicas, min(target.max_replicas, value))


def recommend(
    current: int,
    metrics: TierMetrics,
    target: TierTarget,
    capacity: CapacityModel | None,
    policy: ScalingPolicy,
) -> tuple[int, str]:
    """The replica count this interval's metrics call for, before cool-downs and step limits."""
    tol = policy.tolerance
    tps, ttft = metrics.tokens_per_second_p50, metrics.ttft_p95_seconds
    slots: int | None = None
    model_rec = None
    if capacity is not None:
        capacity = capacity.calibrated(metrics.accepted_per_step, metrics.verify_tokens_per_request)
        max_concurrency = capacity.max_concurrency(target.tokens_per_second)
        slots = max(1, math.floor(max_concurrency * policy.target_utilization))
        model_rec = math.ceil(metrics.demand / slots)

    violations = []
    feedback = current
    if tps is not None and tps < target.tokens_per_second * (1 - tol):
        violations.append(f"per-user p50 {tps:.1f} tok/s < target {target.tokens_per_second:g}")
        feedback = max(feedback, math.ceil(current * target.tokens_per_second / tps))
    if ttft is not None and ttft > target.ttft_p95_seconds * (1 + tol):
        violations.append(f"TTFT p95 {ttft:.2f}s > target {target.ttft_p95_seconds:g}s")
        feedback = max(feedback, math.ceil(current * ttft / target.ttft_p95_seconds))
    if violations:
        rec = max(feedback, current + 1, model_rec or 0)
        return _clamp(rec, target), "; ".join(violations)

    load = f"{metrics.demand:g} requests at {slots} per replica" if slots else f"{metrics.demand:g} requests"
    if model_rec is not None and model_rec > current:
        return _clamp(model_rec, target), f"load model: {load} needs {model_rec}"

    comfortable = (tps is None or tps >= target.tokens_per_second * (1 + tol)) and (
        ttft is None or ttft <= target.ttft_p95_seconds * (1 - tol)
    )
    if comfortable and slots is not None:
        banded = math.ceil(metrics.demand * (1 + tol) / slots)
        if banded < current:
            return _clamp(banded, target), f"SLA met with margin; {load} needs {banded}"
    return _clamp(current, target), "within target band"


def decide(
    current: int,
    metrics: TierMetrics | None,
    target: TierTarget,
    capacity: CapacityModel | None,
    policy: ScalingPolicy,
    memory: ScalingMemory,
    now: float,
) -> Decision:
    """Desired replicas for one tier at time `now` (seconds), with hysteresis and cool-downs."""
    window = tuple((t, r) for t, r in memory.recommendations if now - t < policy.scale_down_cooldown_seconds)
    memory = replace(memory, recommendations=window)

    def hold(rec: int, reason: str) -> Decision:
        return Decision(current, current, rec, reason, memory)

    def scale(desired: int, rec: int, reason: str) -> Decision:
        direction = (desired > current) - (desired < current)
        return Decision(
            current, desired, rec, reason, replace(memory, last_scale_time=now, last_direction=direction)
        )

    if current < target.min_replicas or current > target.max_replicas:
        bounded = _clamp(current, target)
        return scale(bounded, bounded, f"outside [{target.min_replicas}, {target.max_replicas}]")
    if metrics is None:
        return hold(current, "no metrics")

    rec, reason = recommend(current, metrics, target, capacity, policy)
    memory = replace(memory, recommendations=(*window, (now, rec)))
    since_last = math.inf if memory.last_scale_time is None else now - memory.last_scale_time

    if rec > current:
        if since_last < policy.scale_up_cooldown_seconds:
            return hold(
                rec,
                f"{reason}; scale-up cool-down ({policy.scale_up_cooldown_seconds - since_last:.0f}s left)",
            )
        step_cap = max(current + 1, math.ceil(current * policy.max_scale_up_factor))
        return scale(min(rec, step_cap), rec, reason)
    if rec < current:
        stabilized = max(r for _, r in memory.recommendations)
        if stabilized >= current:
            return hold(rec, f"{reason}; stabilizing (recent recommendation {stabilized})")
        if since_last < policy.scale_down_cooldown_seconds:
            return hold(
                rec,
                f"{reason}; scale-down cool-down ({policy.scale_down_cooldown_seconds - since_last:.0f}s left)",
            )
        return scale(stabilized, rec, reason)
    return hold(rec, reason)


def apportion_by_priority(
    desired: Mapping[str, int],
    minimums: Mapping[str, int],
    priorities: Mapping[str, int],
    budget: int | None,
) -> dict[str, int]:
    """Fit tiers' desired replicas into a total budget, highest priority first.

    Minimums are always granted (a budget below their sum cannot be honoured); the rest of the
    budget goes to tiers in priority order (ties by name, for determinism) up to their desire.
    """
    if budget is None or sum(desired.values()) <= budget:
        return dict(desired)
    granted = {name: min(minimums.get(name, 0), want) for name, want in desired.items()}
    left = max(0, budget - sum(granted.values()))
    for name in sorted(desired, key=lambda n: (-priorities.get(n, 0), n)):
        extra = min(left, desired[name] - granted[name])
        granted[name] += extra
        left -= extra
    return granted
