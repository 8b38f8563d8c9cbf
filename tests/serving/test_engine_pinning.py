"""The engine process's intra-op threads pinned one per core: when, to which cores, and the process
that results (built on every core, stepped on its own)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from dspark.serving.config import load_config
from dspark.serving.engine_process import EngineProcess, engine_env
from dspark.serving.threads import GOMP_CPU_AFFINITY, OPENMP_PLACEMENT

from tests.serving.fake_engine import FakeEngine

AVAILABLE = sorted(os.sched_getaffinity(0))


@pytest.fixture
def no_placement(monkeypatch):
    for name in OPENMP_PLACEMENT:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def engine_cpus(available, **overrides):
    return load_config(overrides=overrides, environ={}).engine_cpus(available)


def test_pinned_only_where_the_cores_are_the_one_cpu_replicas_alone():
    # Two CPUs: both threads of a batch step pinned, the stepping thread on the first.
    assert engine_cpus({0, 1}, num_cpus_per_replica=2) == [0, 1]
    # More: the engine's threads take all but one core, which stays the HTTP side's.
    assert engine_cpus({4, 5, 6, 7}, num_cpus_per_replica=4) == [4, 5, 6]
    assert engine_cpus({0, 1}, num_cpus_per_replica=2, engine_threads=1) == [0]
    # Not: switched off, an engine on the replica's thread, replicas that would share the cores, a
    # GPU engine, more threads than cores, or a share of a bigger machine (whose other engines
    # would pin the same first cores).
    assert engine_cpus({0, 1}, num_cpus_per_replica=2, pin_engine_threads=False) is None
    assert engine_cpus({0, 1}, num_cpus_per_replica=2, engine_in_thread=True) is None
    assert engine_cpus({0, 1, 2, 3}, num_cpus_per_replica=2, num_replicas=2) is None
    assert engine_cpus({0, 1}, num_cpus_per_replica=2, num_gpus_per_replica=1) is None
    assert engine_cpus({0, 1}, num_cpus_per_replica=2, device="cuda:0") is None
    assert engine_cpus({0, 1}, num_cpus_per_replica=4) is None
    assert engine_cpus(set(range(64)), num_cpus_per_replica=4) is None


def test_the_users_own_openmp_placement_wins(no_placement):
    assert engine_env([2, 3])[GOMP_CPU_AFFINITY] == "2 3"
    assert GOMP_CPU_AFFINITY not in engine_env(None)
    # An empty GOMP_CPU_AFFINITY is not unset to libgomp (a 2-core engine ran 6x slower): never written.
    assert GOMP_CPU_AFFINITY not in engine_env([])
    no_placement.setenv("OMP_PROC_BIND", "")  # empty: no placement
    assert engine_env([2, 3])[GOMP_CPU_AFFINITY] == "2 3"
    no_placement.setenv("OMP_PROC_BIND", "spread")
    assert GOMP_CPU_AFFINITY not in engine_env([2, 3])


class AffinityProbe(FakeEngine):
    """Reports, as its model name, where its process's threads may run: read when the replica asks
    for the EngineInfo, after the build, once a parallel op has started the OpenMP team."""

    def __init__(self, threads: int):
        super().__init__()
        self.built_on = sorted(os.sched_getaffinity(0))
        self.threads = threads

    @property
    def model_name(self) -> str:
        torch.set_num_threads(self.threads)
        torch.ones(1024, 1024) @ torch.ones(1024, 1024)
        tasks = os.listdir("/proc/self/task")
        return json.dumps(
            {
                "built_on": self.built_on,
                "steps_on": sorted(os.sched_getaffinity(0)),
                "threads": [sorted(os.sched_getaffinity(int(t))) for t in tasks],
                "env": os.environ.get(GOMP_CPU_AFFINITY),
            }
        )

    @model_name.setter
    def model_name(self, _: str) -> None:
        pass


def probe_factory(config) -> AffinityProbe:
    return AffinityProbe(config.thread_plan().batch)


@pytest.mark.parametrize("pin", [True, False])
def test_the_engine_builds_on_every_core_and_steps_on_its_own(no_placement, pin):
    config = load_config(
        overrides={"num_cpus_per_replica": len(AVAILABLE), "pin_engine_threads": pin}, environ={}
    )
    proc = EngineProcess(probe_factory, config)
    try:
        seen = json.loads(proc.info.model_name)
    finally:
        proc.start()
        proc.stop(drain_timeout_s=2)
    assert seen["built_on"] == AVAILABLE  # the compile workers of a build get every core
    if not pin:
        assert proc.pinned_cpus is None and seen["env"] is None and seen["steps_on"] == AVAILABLE
        return
    cpus = proc.pinned_cpus
    assert cpus == AVAILABLE[: len(cpus)] and seen["env"] == " ".join(map(str, cpus))
    assert seen["steps_on"] == cpus[:1]
    if len(cpus) > 1:  # the team's second thread, on the second core
        assert cpus[1:2] in seen["threads"]
