"""Engine step statistics as a policy's `observe_step` receives them."""

from __future__ import annotations

from dspark.engine.outputs import StepStats
from dspark.sps_format import SpsPoint, SpsProfile


def profile(sps: dict[int, float]) -> SpsProfile:
    """A profile with exactly these steps-per-second rates per batch size."""
    points = [SpsPoint(batch_tokens=b, steps_per_second=s) for b, s in sps.items()]
    return SpsProfile(device="cpu", model="toy", dtype="float32", points=points)


def step_stats(
    batch_tokens: int,
    forward_s: float,
    other_s: float = 0.0,
    draft_s: float = 0.0,
    drafted_requests: int = 0,
    predicted: float | None = None,
    accepted: int = 0,
) -> StepStats:
    """A decode step: `drafted_requests` > 0 means the drafter ran for that many requests; its
    `predicted` and `accepted` tokens all count at the first block position."""
    requests = max(drafted_requests, 1)
    return StepStats(
        verify_batch_tokens=batch_tokens,
        verify_budgets=[0] * requests,
        drafted=drafted_requests > 0,
        draft_time_s=draft_s,
        forward_time_s=forward_s,
        step_time_s=forward_s + draft_s + other_s,
        predicted_accepted_tokens=predicted,
        predicted_per_position=[] if predicted is None else [predicted],
        num_accepted_tokens=accepted,
        accepted_per_position=[accepted],
    )
