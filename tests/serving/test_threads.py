"""The engine's intra-op threads per step: the plan, its defaults, and EngineCore applying it."""

from __future__ import annotations

import multiprocessing
from types import SimpleNamespace

import dspark.profiling.profiler as profiler
import pytest
import torch
from dspark.engine.sampling_params import SamplingParams
from dspark.serving.config import load_config
from dspark.serving.engine_core import EngineCore
from dspark.serving.engine_messages import AddRequest, Shutdown, StepReport, Stop
from dspark.serving.threads import ThreadPlan

from tests.profiling.test_profiler_timing import FakeTarget
from tests.profiling.test_profiler_timing import engine as fake_timing_engine
from tests.serving.fake_engine import FakeEngine


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_plan_defaults_by_placement_and_cpus():
    def plan(**overrides):
        return load_config(overrides=overrides, environ={}).thread_plan()

    # In its own process the engine leaves one CPU to the HTTP side, except on two, where batches
    # take both and a lone request keeps one; on the replica's thread it takes them all.
    assert plan(num_cpus_per_replica=4) == ThreadPlan(3, 3)
    assert plan(num_cpus_per_replica=2) == ThreadPlan(single=1, batch=2, time_single=True)
    assert plan(num_cpus_per_replica=1) == ThreadPlan(1, 1)
    assert plan(num_cpus_per_replica=4, engine_in_thread=True) == ThreadPlan(4, 4)
    assert plan(num_cpus_per_replica=2, engine_threads=2) == ThreadPlan(2, 2)  # explicit: every step
    assert [ThreadPlan(1, 2).threads(n) for n in (0, 1, 2, 16)] == [1, 1, 2, 2]


class ThreadSensitiveTarget(FakeTarget):
    """A forward that takes `seconds[threads]` on the fake clock."""

    def __init__(self, seconds: dict[int, float]) -> None:
        super().__init__()
        self.seconds = seconds

    def __call__(self, tokens, batch, cache, hidden_layers=()) -> None:
        self.now += self.seconds.get(torch.get_num_threads(), 0.0)
        self.calls.append(torch.get_num_threads())


def timing_engine(target: FakeTarget) -> SimpleNamespace:
    engine = fake_timing_engine(target)
    engine.has_unfinished_requests = lambda: False
    engine.max_model_len, engine.config = 64, SimpleNamespace(max_batch_tokens=16)
    engine.model_name, engine.dtype = "fake-model", torch.float32
    return engine


@pytest.mark.parametrize("seconds, single", [({1: 2.0, 2: 1.0}, 2), ({1: 1.0, 2: 1.5}, 1)])
def test_a_lone_requests_threads_are_the_faster_count_timed_on_the_engine(
    monkeypatch, tmp_path, restore_threads, seconds, single
):
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    target = ThreadSensitiveTarget(seconds)
    monkeypatch.setattr(profiler, "time", SimpleNamespace(perf_counter=lambda: target.now))
    engine = timing_engine(target)
    torch.set_num_threads(3)

    plan = ThreadPlan(single=1, batch=2, time_single=True).timed(engine)

    assert plan == ThreadPlan(single=single, batch=2)
    assert dict(plan.timed_s) == seconds
    assert torch.get_num_threads() == 3  # restored
    timed = [n for n in target.calls if n != 3]  # the context fill runs at the caller's count
    assert timed.count(1) == timed.count(2) >= 12
    calls = len(target.calls)
    assert ThreadPlan(1, 2).timed(engine) == ThreadPlan(1, 2)  # nothing to time: no forward
    assert len(target.calls) == calls
    # The next start on this model, dtype, CPU and forward reuses the timings: no forward at all.
    again = ThreadPlan(single=1, batch=2, time_single=True).timed(engine)
    assert again == plan and dict(again.timed_s) == seconds
    assert len(target.calls) == calls
    assert len(list((tmp_path / "profiles").glob("fake-model__*__threads-1-2.json"))) == 1


def test_thread_timings_are_taken_again_when_not_stored(monkeypatch, tmp_path, restore_threads):
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    monkeypatch.setenv("DSPARK_STORE_THREAD_TIMINGS", "0")
    target = ThreadSensitiveTarget({1: 1.0, 2: 1.5})
    monkeypatch.setattr(profiler, "time", SimpleNamespace(perf_counter=lambda: target.now))
    engine = timing_engine(target)
    for _ in range(2):
        calls = len(target.calls)
        assert ThreadPlan(single=1, batch=2, time_single=True).timed(engine) == ThreadPlan(1, 2)
        assert len(target.calls) - calls >= 24
    assert not (tmp_path / "profiles").exists()


def test_timings_taken_on_a_busy_machine_are_not_stored(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    noisy = [0.20, 0.12, 0.28, 0.21, 0.13, 0.30, 0.19, 0.25, 0.14, 0.29, 0.22, 0.18]
    timed: list[list[int]] = []

    def decode_seconds_by_threads(engine, counts):
        timed.append(counts)
        return {1: noisy, 2: [0.3] * 12}

    monkeypatch.setattr(profiler, "decode_seconds_by_threads", decode_seconds_by_threads)
    engine = timing_engine(ThreadSensitiveTarget({}))
    for _ in range(2):  # 32% faster on one thread, but within the spread: both threads
        assert ThreadPlan(single=1, batch=2, time_single=True).timed(engine) == ThreadPlan(2, 2)
    assert timed == [[1, 2], [1, 2]]  # timed again at the second start
    assert not list(tmp_path.glob("profiles/*threads*"))


def test_fewer_threads_only_where_clearly_faster():
    plan = ThreadPlan(1, 2, time_single=True)
    assert plan.fastest_single({1: [0.04] * 12, 2: [0.03] * 12}) == ThreadPlan(2, 2)
    assert plan.fastest_single({1: [0.03] * 12, 2: [0.04] * 12}) == ThreadPlan(1, 2)
    # Within the margin (the forward timings of the two counts 5% apart): every step takes both.
    assert plan.fastest_single({1: [0.038] * 12, 2: [0.040] * 12}) == ThreadPlan(2, 2)
    # 20% apart in the median, but the timings spread wider than that: the fixed rule again.
    noisy = [0.020, 0.025, 0.030, 0.032, 0.035, 0.050, 0.060, 0.070]
    assert plan.fastest_single({1: noisy, 2: [0.040] * 8}) == ThreadPlan(2, 2)


def test_engine_core_steps_with_the_plans_threads(restore_threads):
    engine = FakeEngine()
    seen: list[tuple[int, int]] = []
    step = engine.step

    def recording_step():
        seen.append((engine.num_running + engine.num_waiting, torch.get_num_threads()))
        return step()

    engine.step = recording_step
    core_end, replica_end = multiprocessing.Pipe()
    replica_end.send(AddRequest("short", [5, 6], SamplingParams(max_tokens=1, ignore_eos=True)))
    replica_end.send(AddRequest("long", [5, 6], SamplingParams(max_tokens=30, ignore_eos=True)))
    replica_end.send(Stop())
    torch.set_num_threads(3)

    assert EngineCore(engine, core_end, ThreadPlan(single=1, batch=2)).run() == 0

    assert {threads for requests, threads in seen if requests >= 2} == {2}
    assert {threads for requests, threads in seen if requests == 1} == {1}
    messages = []
    while replica_end.poll():
        messages.append(replica_end.recv())
    assert isinstance(messages[-1], Shutdown)
    finished = {o.request_id for m in messages if isinstance(m, StepReport) for o in m.outputs if o.finished}
    assert finished == {"short", "long"}
