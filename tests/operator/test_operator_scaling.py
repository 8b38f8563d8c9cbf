"""The autoscaler's pure decision logic: rules, and behaviour on recorded demand traces."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from dspark.sps_format import SpsProfile
from dspark_operator.scaling import (
    CapacityModel,
    ScalingMemory,
    ScalingPolicy,
    TierMetrics,
    TierTarget,
    apportion_by_priority,
    decide,
)
from operator_fixtures import PROFILE

CAPACITY = CapacityModel(
    SpsProfile.model_validate(PROFILE), accepted_per_step=2.0, verify_tokens_per_request=4.0
)
TARGET = TierTarget(tokens_per_second=40, ttft_p95_seconds=1.0, min_replicas=1, max_replicas=16)
POLICY = ScalingPolicy(
    tolerance=0.1, scale_up_cooldown_seconds=60, scale_down_cooldown_seconds=300, max_scale_up_factor=2.0
)
INTERVAL = 15.0
SLOTS = math.floor(CAPACITY.max_concurrency(40) * POLICY.target_utilization)


def test_capacity_model_matches_profile():
    # speed(n) = 2 * 1000 / (18 + 0.25 * 4n) = 2000 / (18 + n): 40 tok/s holds up to n = 32.
    assert CAPACITY.per_user_tokens_per_second(32) == pytest.approx(2000 / 50, rel=1e-3)
    assert CAPACITY.max_concurrency(40) == 32
    assert CAPACITY.max_concurrency(500) == 0  # even one request is slower than that
    assert CAPACITY.calibrated(3.0, None).max_concurrency(40) > 32  # more accepted tokens, more users


def metrics(tps: float | None, ttft: float | None = 0.3, running: float = 10) -> TierMetrics:
    return TierMetrics(tokens_per_second_p50=tps, ttft_p95_seconds=ttft, requests_running=running)


def test_outside_bounds_is_clamped_at_once():
    memory = ScalingMemory(last_scale_time=0.0)
    assert decide(20, metrics(60), TARGET, CAPACITY, POLICY, memory, now=1).desired == 16
    assert decide(0, None, TARGET, CAPACITY, POLICY, memory, now=1).desired == 1


def test_no_metrics_holds():
    d = decide(3, None, TARGET, CAPACITY, POLICY, ScalingMemory(), now=1000)
    assert d.desired == 3 and d.reason == "no metrics"


def test_violation_scales_up_by_ratio_capped_by_factor():
    d = decide(2, metrics(10), TARGET, CAPACITY, POLICY, ScalingMemory(), now=1000)
    assert d.recommendation == 8  # 2 * 40 / 10
    assert d.desired == 4  # at most doubling per step
    assert "per-user p50" in d.reason and d.memory.last_scale_time == 1000


def test_ttft_violation_scales_up():
    d = decide(2, metrics(45, ttft=3.0), TARGET, CAPACITY, POLICY, ScalingMemory(), now=1000)
    assert d.desired == 4 and "TTFT" in d.reason


def test_scale_up_waits_for_cool_down():
    memory = ScalingMemory(last_scale_time=990.0, last_direction=1)
    d = decide(2, metrics(10), TARGET, CAPACITY, POLICY, memory, now=1000)
    assert d.desired == 2 and "cool-down" in d.reason
    assert decide(2, metrics(10), TARGET, CAPACITY, POLICY, memory, now=1051).desired == 4


def test_within_band_holds():
    # 60 users on 3 replicas = 20 each (< 28 slots); speed just on target.
    d = decide(3, metrics(41, running=60), TARGET, CAPACITY, POLICY, ScalingMemory(), now=1000)
    assert d.desired == 3 and d.reason == "within target band"


def test_scale_down_needs_cool_down_and_stable_window():
    m = metrics(80, ttft=0.2, running=20)  # one replica's worth of load on 4 replicas
    recent = ScalingMemory(last_scale_time=900.0)
    assert decide(4, m, TARGET, CAPACITY, POLICY, recent, now=1000).desired == 4  # cool-down
    higher = ScalingMemory(last_scale_time=0.0, recommendations=((800.0, 4),))
    assert decide(4, m, TARGET, CAPACITY, POLICY, higher, now=1000).desired == 4  # window still says 4
    settled = ScalingMemory(last_scale_time=0.0, recommendations=((800.0, 2), (900.0, 1)))
    d = decide(4, m, TARGET, CAPACITY, POLICY, settled, now=1000)
    assert d.desired == 2 and d.direction == -1  # the highest recent recommendation


def test_memory_round_trips_through_status():
    memory = ScalingMemory(last_scale_time=12.5, last_direction=-1, recommendations=((1.0, 3), (2.0, 4)))
    assert ScalingMemory.from_status(memory.to_status()) == memory
    assert ScalingMemory.from_status(None) == ScalingMemory()


def test_apportion_by_priority():
    desired = {"gold": 6, "silver": 4, "bronze": 3}
    mins = {"gold": 1, "silver": 1, "bronze": 1}
    prio = {"gold": 10, "silver": 5, "bronze": 0}
    assert apportion_by_priority(desired, mins, prio, None) == desired
    assert apportion_by_priority(desired, mins, prio, 9) == {"gold": 6, "silver": 2, "bronze": 1}
    assert apportion_by_priority(desired, mins, prio, 2) == {"gold": 1, "silver": 1, "bronze": 1}  # mins hold


# ---- recorded traces -------------------------------------------------------------------------
# The plant: `demand` concurrent users spread evenly over the replicas; each sees the speed the
# profile predicts at its replica's concurrency (times a noise factor); TTFT grows past capacity.


def plant(demand: float, replicas: int, noise: float = 1.0) -> TierMetrics:
    per_replica = demand / max(replicas, 1)
    tps = CAPACITY.per_user_tokens_per_second(per_replica) * noise if demand > 0 else None
    ttft = 0.3 * (1 + max(0.0, per_replica - 32) / 8) if demand > 0 else None
    return TierMetrics(tokens_per_second_p50=tps, ttft_p95_seconds=ttft, requests_running=demand)


def required(demand: float) -> int:
    return max(TARGET.min_replicas, math.ceil(demand / SLOTS))


def simulate(trace: list[float], noise: list[float] | None = None, start: int = 1) -> list[int]:
    replicas, memory, history = start, ScalingMemory(last_scale_time=-1e9), []
    for i, demand in enumerate(trace):
        decision = decide(
            replicas,
            plant(demand, replicas, noise[i] if noise else 1.0),
            TARGET,
            CAPACITY,
            POLICY,
            memory,
            now=i * INTERVAL,
        )
        replicas, memory = decision.desired, decision.memory
        history.append(replicas)
    return history


def reversals_per_window(history: list[int]) -> int:
    """The most direction reversals within any scale-down cool-down window."""
    moves = [(i, (b > a) - (b < a)) for i, (a, b) in enumerate(itertools.pairwise(history)) if a != b]
    flips = [i for (i, d), (_, prev) in zip(moves[1:], moves, strict=False) if d != prev]
    window = POLICY.scale_down_cooldown_seconds / INTERVAL
    return max((sum(1 for j in flips if i <= j < i + window) for i in flips), default=0)


def intervals_to_reach(history: list[int], start: int, goal: int) -> int:
    return next(i - start for i in range(start, len(history)) if history[i] == goal)


def up_bound(start: int, goal: int) -> int:
    """The documented bound: ceil(log2(goal/start)) scale-ups, one per scale-up cool-down."""
    steps = math.ceil(math.log(goal / start, POLICY.max_scale_up_factor))
    return steps * math.ceil(POLICY.scale_up_cooldown_seconds / INTERVAL) + 1


def assert_holds_sla(history: list[int], trace: list[float], since: int) -> None:
    for replicas, demand in zip(history[since:], trace[since:], strict=True):
        tps = plant(demand, replicas).tokens_per_second_p50
        assert tps is None or tps >= TARGET.tokens_per_second * (1 - POLICY.tolerance)


def test_trace_steady():
    trace = [100.0] * 120
    history = simulate(trace)
    goal = required(100)
    reached = intervals_to_reach(history, 0, goal)
    assert reached <= up_bound(1, goal)
    assert set(history[reached:]) == {goal}
    assert reversals_per_window(history) == 0


def test_trace_ramp():
    trace = [20 + 180 * min(i, 60) / 60 for i in range(160)]
    history = simulate(trace)
    goal = required(200)
    assert intervals_to_reach(history, 60, goal) <= up_bound(max(history[60], 1), goal)
    assert history == sorted(history)  # a ramp up never scales down
    assert_holds_sla(history, trace, 60 + up_bound(max(history[60], 1), goal))


def test_trace_spike():
    trace = [40.0] * 30 + [300.0] * 40 + [40.0] * 90
    history = simulate(trace)
    high, low = required(300), required(40)
    assert history[29] == low
    assert intervals_to_reach(history, 30, high) <= up_bound(low, high)
    # Down only after the stabilization window and cool-down have both passed, in one step.
    down = intervals_to_reach(history, 70, low)
    assert (
        POLICY.scale_down_cooldown_seconds / INTERVAL - 1
        <= down
        <= POLICY.scale_down_cooldown_seconds / INTERVAL + 2
    )
    assert reversals_per_window(history) <= 1


def test_trace_noisy():
    rng = random.Random(7)
    trace = [max(0.0, 100 + rng.gauss(0, 12)) for _ in range(240)]
    noise = [1 + rng.uniform(-0.08, 0.08) for _ in range(240)]
    history = simulate(trace, noise)
    assert reversals_per_window(history) <= 1
    goal = required(100)
    assert intervals_to_reach(history, 0, goal) <= up_bound(1, goal)
    settled = history[up_bound(1, goal) :]
    assert max(settled) - min(settled) <= 1  # noise moves it at most one replica
    assert_holds_sla(history, [min(d, 100.0) for d in trace], up_bound(1, goal))
