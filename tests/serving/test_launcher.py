"""`serve_forever`'s way out: an interrupt drains a server that serves, and stops one still
starting at once (a replica loading its engine would hold a drain for the whole grace period)."""

from __future__ import annotations

import signal

import pytest
from dspark.serving import launcher
from dspark.serving.config import ServeConfig


@pytest.fixture
def stops(monkeypatch) -> list[bool]:
    """Ray, the model and the signal handlers stubbed out; records each shutdown's `drain` (and, in
    `stops.kept`, its `keep_cluster`)."""
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


def test_an_interrupt_during_start_up_stops_without_draining(monkeypatch, stops):
    monkeypatch.setattr(launcher, "run_openai_server", _interrupt)
    said: list[str] = []
    launcher.serve_forever(ServeConfig(), announce=said.append)
    assert stops == [False] and stops.kept == [False] and stops.started == ["local"]
    assert said[-2:] == ["stopping before start-up finished", "stopped"]
    assert not any("DSpark Serve on" in line for line in said)


def test_an_interrupt_while_serving_drains(monkeypatch, stops):
    class Forever:
        def wait(self):
            raise KeyboardInterrupt

    monkeypatch.setattr(launcher, "run_openai_server", lambda config: None)
    monkeypatch.setattr(launcher.threading, "Event", Forever)
    said: list[str] = []
    launcher.serve_forever(ServeConfig(), announce=said.append)
    assert stops == [True]
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
