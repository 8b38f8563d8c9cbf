"""Steps much slower than the start-up measurements predict, and collapsed OpenMP teams: the
predictor's figures, the log's warning (once a minute at most) and the metrics."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
from dspark.engine.outputs import StepStats
from dspark.models.compiled_forward import CompiledForward
from dspark.serving.metrics import ServingMetrics
from dspark.serving.step_pace import WINDOW, StepPace
from dspark.serving.step_prediction import StepPredictor
from dspark.serving.threads import ThreadPlan
from dspark.sps_format import SpsPoint, SpsProfile

MODEL = "m"
PROFILE = SpsProfile(
    device="cpu",
    model=MODEL,
    dtype="float32",
    engine={"forward": "eager"},
    points=[SpsPoint(batch_tokens=b, steps_per_second=s) for b, s in ((1, 25.0), (8, 20.0), (64, 10.0))],
)
# Start-up timings of a lone request's decode forward: 40 ms on one thread, 36 ms on two.
PLAN = ThreadPlan(1, 2, time_single=True).fastest_single({1: [0.040] * 12, 2: [0.036] * 12})


def predictor(profile: SpsProfile | None = PROFILE, plan: ThreadPlan | None = PLAN, forward=None):
    return StepPredictor(profile, plan, SimpleNamespace(forward=forward))


def step(batch_tokens: int, threads: int, forward_s: float, cpu_per_s: float, **fields) -> StepStats:
    """A decode step of `batch_tokens` whose forward took `forward_s`, using `cpu_per_s` cores."""
    return StepStats(
        verify_batch_tokens=batch_tokens,
        intra_op_threads=threads,
        forward_time_s=forward_s,
        step_time_s=forward_s + 0.001,
        forward_cpu_s=forward_s * cpu_per_s,
        **fields,
    )


def sample(metrics: ServingMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": MODEL, **labels})


def serve_steps(metrics: ServingMetrics, stats: list[StepStats], plan=PLAN) -> None:
    """The engine process's annotation, then the replica's metrics, as a served step goes."""
    p = predictor(plan=plan)
    for s in stats:
        p.annotate(s)
        metrics.observe_step(s)


def test_the_plan_keeps_its_start_up_medians():
    assert dict(PLAN.timed_s) == {1: 0.040, 2: 0.036}
    assert PLAN.single == 2  # 10% apart at most: both threads


def test_predictions_come_from_the_plan_for_a_lone_decode_and_from_the_profile_otherwise():
    lone, batch, prefill = step(1, 2, 0.04, 1.9), step(8, 2, 0.05, 1.9), step(8, 2, 0.05, 1.9)
    prefill.num_prefill_tokens = 8
    p = predictor()
    for s in (lone, batch, prefill):
        p.annotate(s)
    assert (lone.predicted_forward_s, lone.prediction_source) == (0.036, "thread_plan")
    assert batch.predicted_forward_s == pytest.approx(1 / 20.0)
    assert batch.prediction_source == "profile"
    assert prefill.predicted_forward_s is None  # prompt chunks: neither measured them

    # The profile was measured at the batch's threads, on the eager forward: nothing else is held to it.
    other_threads = step(8, 1, 0.05, 1.0)
    predictor().annotate(other_threads)
    assert other_threads.predicted_forward_s is None
    compiled = step(8, 2, 0.05, 1.9)
    predictor(forward=CompiledForward.__new__(CompiledForward)).annotate(compiled)
    assert compiled.predicted_forward_s is None
    unplanned = step(1, 2, 0.04, 1.9)
    predictor(profile=None, plan=None).annotate(unplanned)
    assert unplanned.predicted_forward_s is None


def test_steps_at_their_predicted_pace_raise_nothing(caplog):
    metrics = ServingMetrics(MODEL)
    with caplog.at_level(logging.WARNING, "dspark.serving.step_pace"):
        serve_steps(metrics, [step(1, 2, 0.038, 1.8) for _ in range(WINDOW)])
        serve_steps(metrics, [step(8, 2, 0.052, 1.8) for _ in range(WINDOW)])

    assert caplog.records == []
    assert sample(metrics, "dspark_slow_steps_total", source="thread_plan") == 0
    assert sample(metrics, "dspark_slow_steps_total", source="profile") == 0
    assert sample(metrics, "dspark_openmp_team_collapsed") == 0
    assert sample(metrics, "dspark_step_slowdown") == pytest.approx(1.06, abs=0.02)
    assert sample(metrics, "dspark_intra_op_parallelism") == pytest.approx(1.8)


def test_a_collapsed_team_three_times_slower_than_its_plan_is_logged_and_exported(caplog):
    metrics = ServingMetrics(MODEL)
    with caplog.at_level(logging.WARNING, "dspark.serving.step_pace"):
        # One request on two threads: 108 ms a step against the 36 ms timed, one core busy.
        serve_steps(metrics, [step(1, 2, 0.108, 1.0) for _ in range(WINDOW)])

    assert len(caplog.records) == 1  # once, although every step of the window was slow
    message = caplog.records[0].getMessage()
    assert "3.0x slower than the thread plan's start-up timing" in message
    assert "OpenMP team has collapsed" in message
    assert sample(metrics, "dspark_slow_steps_total", source="thread_plan") == WINDOW
    assert sample(metrics, "dspark_step_slowdown") == pytest.approx(3.03, abs=0.02)
    assert sample(metrics, "dspark_openmp_team_collapsed") == 1
    assert sample(metrics, "dspark_intra_op_parallelism") == pytest.approx(1.0)

    serve_steps(metrics, [step(1, 2, 0.036, 1.9) for _ in range(WINDOW)])  # recovered
    assert sample(metrics, "dspark_openmp_team_collapsed") == 0
    assert sample(metrics, "dspark_step_slowdown") < 1.1


def test_slow_steps_on_a_busy_team_are_slow_but_no_collapse(caplog):
    metrics = ServingMetrics(MODEL)
    with caplog.at_level(logging.WARNING, "dspark.serving.step_pace"):
        serve_steps(metrics, [step(8, 2, 0.15, 1.9) for _ in range(WINDOW)])  # 3x the profile's 50 ms

    (record,) = caplog.records
    assert "slower than the SPS profile predicts" in record.getMessage()
    assert "collapsed" not in record.getMessage()
    assert sample(metrics, "dspark_slow_steps_total", source="profile") == WINDOW
    assert sample(metrics, "dspark_openmp_team_collapsed") == 0


def test_one_stalled_step_is_no_slowdown(caplog):
    metrics = ServingMetrics(MODEL)
    stats = [step(1, 2, 0.036, 1.9) for _ in range(WINDOW)]
    stats[5] = step(1, 2, 0.5, 1.0)
    with caplog.at_level(logging.WARNING, "dspark.serving.step_pace"):
        serve_steps(metrics, stats)
    assert caplog.records == []
    assert sample(metrics, "dspark_slow_steps_total", source="thread_plan") == 1  # counted, not warned
    assert sample(metrics, "dspark_openmp_team_collapsed") == 0


def test_the_warning_repeats_at_most_once_per_interval(caplog):
    now = [0.0]
    pace = StepPace(log_interval_s=60.0, clock=lambda: now[0])
    slow = step(1, 1, 0.12, 1.0, predicted_forward_s=0.04, prediction_source="thread_plan")
    with caplog.at_level(logging.WARNING, "dspark.serving.step_pace"):
        for _ in range(3 * WINDOW):
            now[0] += 1.0
            verdict = pace.observe(slow)
        assert verdict.slow and not verdict.collapsed  # one thread: no team to collapse
        assert len(caplog.records) == 1
        now[0] += 60.0
        pace.observe(slow)
    assert len(caplog.records) == 2


def test_a_window_not_yet_full_is_not_judged():
    pace = StepPace()
    slow = step(1, 2, 0.12, 1.0, predicted_forward_s=0.04, prediction_source="thread_plan")
    verdicts = [pace.observe(slow) for _ in range(WINDOW)]
    assert not any(v.slow for v in verdicts[:-1]) and verdicts[-1].slow
    assert math.isclose(verdicts[0].slowdown, 3.025, rel_tol=1e-3)
    assert pace.observe(StepStats()) is None  # no prediction: nothing to judge
