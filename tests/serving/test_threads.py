"""The engine's intra-op threads per step: the plan, its defaults, and EngineCore applying it."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from dspark.engine.sampling_params import SamplingParams
from dspark.serving.config import load_config
from dspark.serving.engine_core import EngineCore
from dspark.serving.engine_messages import AddRequest, Shutdown, StepReport, Stop
from dspark.serving.threads import ThreadPlan

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
    assert plan(num_cpus_per_replica=2) == ThreadPlan(single=1, batch=2)
    assert plan(num_cpus_per_replica=1) == ThreadPlan(1, 1)
    assert plan(num_cpus_per_replica=4, engine_in_thread=True) == ThreadPlan(4, 4)
    assert plan(num_cpus_per_replica=2, engine_threads=2) == ThreadPlan(2, 2)  # explicit: every step
    assert [ThreadPlan(1, 2).threads(n) for n in (0, 1, 2, 16)] == [1, 1, 2, 2]


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
