"""`serve_forever`'s way out: an interrupt drains a server that serves, and stops one still
starting at once (a replica loading its engine would hold a drain for the whole grace period);
the engine process it prestarted goes either way."""

from __future__ import annotations

import signal

import pytest
from dspark.serving import launcher
from dspark.serving.config import ServeConfig
from dspark.serving.engine_prestart import PRESTARTED_ENGINE_ENV, should_prestart


class Prestarted:
    """Stands in for the prestarted engine process."""

    closed = False

    def replica_env(self) -> dict[str, str]:
        return {PRESTARTED_ENGINE_ENV: "/prestarted.sock"}

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def prestarted(monkeypatch) -> Prestarted:
    engine = Prestarted()
    monkeypatch.setattr(launcher, "prestart_engine", lambda config: engine)
    return engine


@pytest.fixture
def stops(monkeypatch, prestarted) -> list[bool]:
    """Ray, the model, the prestarted engine and the signal handlers stubbed out; records each
    shutdown's `drain` (and, in `stops.kept`, its `keep_cluster`)."""
    drains = Stops()

    def shutdown(drain: bool = True, keep_cluster: bool = False) -> None:
        drains.append(drain)
        drains.kept.append(keep_cluster)

    monkeypatch.setattr(launcher, "check_port_free", lambda host, port: None)
    monkeypatch.setattr(launcher, "prepare_model", lambda config: None)
    monkeypatch.setattr(launcher, "start_ray", lambda **kwargs: drains.started.append("local"))
    monkeypatch.setattr(launcher, "connect_ray", lambda address: drains.started.append(address))
    monkeypatch.setattr(launcher, "shutdown", shutdown)
    monkeypatch.setattr(signal, "signal", lambda sig, handler: None)
    return drains


class Stops(list):
    def __init__(self) -> None:
        super().__init__()
        self.kept: list[bool] = []
        self.started: list[str] = []


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_an_interrupt_during_start_up_stops_without_draining(monkeypatch, stops, prestarted):
    monkeypatch.setattr(launcher, "run_openai_server", _interrupt)
    said: list[str] = []
    launcher.serve_forever(ServeConfig(), announce=said.append)
    assert stops == [False] and stops.kept == [False] and stops.started == ["local"] and prestarted.closed
    assert said[-2:] == ["stopping before start-up finished", "stopped"]
    assert not any("DSpark Serve on" in line for line in said)


def test_an_interrupt_while_serving_drains(monkeypatch, stops, prestarted):
    class Forever:
        def wait(self):
            raise KeyboardInterrupt

    monkeypatch.setattr(launcher, "run_openai_server", lambda config: None)
    monkeypatch.setattr(launcher.threading, "Event", Forever)
    said: list[str] = []
    launcher.serve_forever(ServeConfig(), announce=said.append)
    assert stops == [True] and prestarted.closed
    assert said[-2:] == ["shutting down: draining in-flight requests", "stopped"]


def test_on_a_cluster_it_joins_and_leaves_the_cluster_running(monkeypatch, stops):
    def no_port_check(host, port):
        raise AssertionError("the port is the cluster's proxies', not this machine's")

    monkeypatch.setattr(launcher, "check_port_free", no_port_check)
    monkeypatch.setattr(launcher, "run_openai_server", _interrupt)
    said: list[str] = []
    launcher.serve_forever(ServeConfig(address="ray://head:10001"), announce=said.append)
    assert stops.started == ["ray://head:10001"] and stops == [False] and stops.kept == [True]
    assert "joining the Ray cluster at ray://head:10001" in said[0]


def test_the_replicas_learn_where_the_prestarted_engine_waits(monkeypatch, stops, prestarted):
    envs: list[dict[str, str]] = []
    monkeypatch.setattr(launcher, "start_ray", lambda num_cpus, env: envs.append(env))
    monkeypatch.setattr(launcher, "run_openai_server", _interrupt)
    launcher.serve_forever(ServeConfig(), announce=lambda line: None)
    assert envs[0][PRESTARTED_ENGINE_ENV] == "/prestarted.sock"


def test_a_failed_model_pull_leaves_no_prestarted_engine(monkeypatch, stops, prestarted):
    def no_model(config):
        raise RuntimeError("no such model")

    monkeypatch.setattr(launcher, "prepare_model", no_model)
    with pytest.raises(RuntimeError, match="no such model"):
        launcher.serve_forever(ServeConfig(), announce=lambda line: None)
    assert prestarted.closed


@pytest.mark.parametrize(
    ("settings", "prestarts"),
    [
        ({}, True),
        ({"engine_in_thread": True}, False),
        ({"num_replicas": 2}, False),
        ({"num_gpus_per_replica": 1}, False),
        ({"device": "cuda:0"}, False),
        ({"address": "ray://head:10001"}, False),
    ],
)
def test_only_the_one_cpu_replica_of_a_local_server_gets_a_prestarted_engine(settings, prestarts):
    assert should_prestart(ServeConfig(**settings)) is prestarts
