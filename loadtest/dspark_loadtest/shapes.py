"""Load shapes as a list of stages: how many users to run until when (pure; Locust's shape calls it)."""

from __future__ import annotations

from typing import NamedTuple

from dspark_loadtest.tiers import ConstantLoad, SpikeLoad, StepLoad


class Stage(NamedTuple):
    until_s: float  # the stage runs while elapsed time < until_s
    users: int
    spawn_rate: float


def stages(load: ConstantLoad | StepLoad | SpikeLoad) -> list[Stage]:
    """The stages of a load shape, ending at its duration."""
    if isinstance(load, ConstantLoad):
        return [Stage(load.duration, load.users, load.spawn_rate)]
    if isinstance(load, StepLoad):
        out, users, t = [], load.start_users, 0.0
        while t + load.step_seconds < load.duration and users < load.max_users:
            t += load.step_seconds
            out.append(Stage(t, users, load.spawn_rate))
            users = min(users + load.step_users, load.max_users)
        out.append(Stage(load.duration, users, load.spawn_rate))
        return out
    spike_end = min(load.spike_at + load.spike_seconds, load.duration)
    out = []
    if load.spike_at > 0:
        out.append(Stage(min(load.spike_at, load.duration), load.base_users, load.spawn_rate))
    if load.spike_at < load.duration:
        out.append(Stage(spike_end, load.spike_users, load.spawn_rate))
    if spike_end < load.duration:
        out.append(Stage(load.duration, load.base_users, load.spawn_rate))
    return out


def stage_at(plan: list[Stage], elapsed_s: float) -> Stage | None:
    """The stage running at `elapsed_s`, or None once the plan is over (the run stops)."""
    for stage in plan:
        if elapsed_s < stage.until_s:
            return stage
    return None


def peak_users(plan: list[Stage]) -> int:
    return max(s.users for s in plan)
