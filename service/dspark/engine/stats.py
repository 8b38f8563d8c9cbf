"""A step's statistics, folded in one place from what its phases returned."""

from __future__ import annotations

from dspark.engine.drafting import Draft, DraftReport
from dspark.engine.outputs import StepStats
from dspark.engine.scheduler import StepPlan


def step_stats(
    plan: StepPlan,
    draft: Draft,
    report: DraftReport,
    accepted: list[int],
    gamma: int,
    queues: tuple[int, int],
    prefix: tuple[int, int],
    forward_time_s: float,
    step_time_s: float,
) -> StepStats:
    """`accepted`: draft tokens accepted per decode; `queues`: (running, waiting) after the step;
    `prefix`: the prefix cache's (queried, hit) prompt tokens of the requests admitted."""
    per_position = [0] * gamma
    for n in accepted:
        for k in range(n):
            per_position[k] += 1
    return StepStats(
        num_running=queues[0],
        num_waiting=queues[1],
        num_prefill_tokens=sum(c for _, c in plan.prefills),
        prefix_cache_queries=prefix[0],
        prefix_cache_hits=prefix[1],
        verify_batch_tokens=sum(1 + n for n in draft.carried),
        num_drafts=sum(n > 0 for n in draft.lengths),
        num_draft_tokens=sum(draft.lengths),
        num_accepted_tokens=sum(accepted),
        accepted_per_position=per_position,
        verify_budgets=list(draft.lengths),
        predicted_accepted_tokens=report.predicted_accepted_tokens,
        predicted_per_position=report.predicted_per_position,
        policy_fallback=report.policy_fallback,
        drafted=report.drafted,
        draft_horizon=report.horizon,
        draft_time_s=report.draft_time_s,
        schedule_time_s=report.schedule_time_s,
        forward_time_s=forward_time_s,
        step_time_s=step_time_s,
    )
