"""`serve_forever`'s way out: an interrupt drains a server that serves, and stops one still
starting at once (a replica loading its engine would hold a drain for the whole grace period)."""

from __future__ import annotations

import signal

import pytest
from dspark.serving import launcher
from dspark.serving.config import ServeConfig


@pytest.fixture
def stops(monkeypatch) -> list[bool]:
    """Ray, the model and the signal handlers stubbed out; records each shutdown's `drain`."""
    drains: list[bool] = []
    monkeypatch.setattr(launcher, "check_port_free", lambda host, port: None)
    monkeypatch.setattr(launcher, "prepare_model", lambda config: None)
    monkeypatch.setattr(launcher, "start_ray", lambda **kwargs: None)
    monkeypatch.setattr(launcher, "shutdown", lambda drain=True: drains.append(drain))
    monkeypatch.setattr(signal, "signal", lambda sig, handler: None)
    return drains


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_an_interrupt_during_start_up_stops_without_draining(monkeypatch, stops):
    monkeypatch.setattr(launcher, "run_openai_server", _interrupt)
    said: list[str] = []
    launcher.serve_forever(ServeConfig(), announce=said.append)
    assert stops == [False]
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
