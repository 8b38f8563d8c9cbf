"""A dead or hung engine, over the fake engine: in-flight requests get 503 with Retry-After, `/health`
answers 503 until the replica restarted its engine process, Ray's health check fails where the
replica cannot recover by itself, and a request past its deadline gets 504. The engine is killed
or stopped with real signals; the same against the real server is in test_live_faults.py."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import pytest
from dspark.serving.config import ServeConfig
from dspark.serving.engine_process import EngineProcess
from dspark.serving.replica import EngineReplica

from tests.serving.conftest import make_client, make_process_replica, make_replica
from tests.serving.fake_engine import FakeEngine, fake_engine_factory
from tests.serving.test_engine_process import LONG, start

BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 200, "temperature": 0}


def wait_for(predicate, timeout_s: float, interval_s: float = 0.05) -> float:
    """Seconds until `predicate()` held; AssertionError after `timeout_s`."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(interval_s)
    return time.monotonic() - started


def in_background(client, body: dict) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(client.post("/v1/completions", json=body)))
    thread.start()
    return thread, result


def streaming(client, body: dict) -> tuple[threading.Thread, list, threading.Event]:
    """A streamed request in the background; the event is set at its first event."""
    lines: list[str] = []
    first = threading.Event()

    def run() -> None:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    first.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, lines, first


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_dead_or_stopped_engine_fails_in_flight_requests_and_is_restarted(sig):
    slow = functools.partial(fake_engine_factory, step_delay_s=0.05, max_model_len=100_000)
    config = ServeConfig(max_output_tokens=1000, engine_stall_timeout_s=1.0, retry_after_s=3)
    replica = EngineReplica(config, factory=slow)
    try:
        with make_client(replica) as c:
            body = {**BODY, "max_tokens": 900}  # 300 steps at least: in flight when the signal comes
            stream_thread, lines, first = streaming(c, body)
            plain_thread, plain = in_background(c, body)
            assert first.wait(30)
            old_pid = replica.loop.pid
            os.kill(old_pid, sig)
            started = time.monotonic()
            plain_thread.join(10)
            stream_thread.join(10)
            assert time.monotonic() - started < 10 and not plain_thread.is_alive()
            assert plain[0].status_code == 503 and plain[0].headers["retry-after"] == "3"
            assert plain[0].json()["error"]["type"] == "ServiceUnavailableError"
            assert lines[-1] == "data: [DONE]" and '"code":503' in lines[-2], lines[-3:]
            # /health said 503 meanwhile (the watchdog restarts within a second, so look at the
            # replica's own view too), Ray's check passes: the replica recovers by itself.
            wait_for(lambda: c.get("/health").status_code == 200, 60)
            assert replica.restarts == 1 and replica.loop.pid != old_pid
            replica.check_health()
            assert c.post("/v1/completions", json={**BODY, "max_tokens": 5}).status_code == 200
    finally:
        replica.shutdown()


def test_health_is_503_while_the_engine_is_down_and_ray_replaces_a_replica_past_its_restarts():
    replica = make_process_replica(max_engine_restarts=0)
    try:
        with make_client(replica) as c:
            assert c.get("/health").status_code == 200
            replica.check_health()
            os.kill(replica.loop.pid, signal.SIGKILL)
            wait_for(lambda: c.get("/health").status_code == 503, 10)
            body = c.get("/health").json()
            assert body["status"] == "unhealthy" and "killed by signal 9" in body["reason"]
            with pytest.raises(RuntimeError, match="killed by signal 9"):
                replica.check_health()
            r = c.post("/v1/completions", json={**BODY, "max_tokens": 5})
            assert r.status_code == 503 and "retry-after" in r.headers
            assert c.get("/ready").status_code == 503
    finally:
        replica.shutdown()


def test_a_hung_engine_thread_fails_the_health_check():
    """An engine on a thread cannot be killed: a step that does not return makes the replica
    unhealthy, so that Ray replaces it."""
    engine = FakeEngine(step_delay_s=3.0)
    replica = make_replica(engine, engine_stall_timeout_s=0.5)
    try:
        with make_client(replica) as c:
            thread, _ = in_background(c, {**BODY, "max_tokens": 3})
            wait_for(lambda: c.get("/health").status_code == 503, 10)
            assert "no progress" in c.get("/health").json()["reason"]
            with pytest.raises(RuntimeError, match="engine hung"):
                replica.check_health()
            thread.join(30)
    finally:
        replica.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_past_its_deadline_gets_504(stream):
    replica = make_replica(
        FakeEngine(step_delay_s=0.05, max_model_len=100_000), request_timeout_s=0.5, max_output_tokens=1000
    )
    try:
        with make_client(replica) as c:
            started = time.monotonic()
            r = c.post("/v1/completions", json={**BODY, "max_tokens": 900, "stream": stream})
            assert time.monotonic() - started < 5
            if stream:
                assert (
                    r.status_code == 200
                    and '"code":"request_timeout"' in r.text
                    and r.text.endswith("data: [DONE]\n\n")
                )
            else:
                assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
            wait_for(
                lambda: replica.client.in_flight == 0 and not replica.loop.engine.has_unfinished_requests(), 5
            )
            assert c.post("/v1/completions", json={**BODY, "max_tokens": 5}).status_code == 200
    finally:
        replica.shutdown()


def test_sending_to_a_stopped_engine_never_blocks():
    """A stopped engine reads nothing: the socket fills, and a blocking send would stop the caller
    (the event loop). Adds return at once; the requests wait in the writer's queue."""
    proc = start()
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        prompt = list(range(1, 90)) * 2000  # ~0.5 MB pickled: 40 of them overfill any socket buffer
        started = time.monotonic()
        for i in range(40):
            proc.add(prompt, LONG, f"r{i}", lambda out: None)
        assert time.monotonic() - started < 5
        assert proc.stalled_s() > 0
        proc.kill("engine hung")
        wait_for(lambda: not proc.alive, 10)
        assert proc.fatal_error == "engine hung"
    finally:
        proc.stop(1)


def test_the_stall_clock_runs_only_with_requests_open():
    proc: EngineProcess = start(step_delay_s=0.01)
    try:
        time.sleep(0.3)
        assert proc.stalled_s() == 0.0  # idle: nothing owed
        os.kill(proc.pid, signal.SIGSTOP)
        proc.add([1, 2], LONG, "r", lambda out: None)
        time.sleep(0.3)
        assert 0.2 < proc.stalled_s() < 5
        os.kill(proc.pid, signal.SIGCONT)
        wait_for(lambda: proc.stalled_s() < 0.2, 10)
    finally:
        proc.stop(1)


def test_the_kserve_front_ends_health_follows_the_engine_replica(monkeypatch):
    import kserve.model_server
    from dspark.serving.kserve_model import build_kserve_server
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from tests.serving.test_auth_routes import FakeHandle, _Method

    class DeadEngineHandle(FakeHandle):
        health = _Method("engine failure: the engine process exited (killed by signal 9)")

    app = FastAPI()
    monkeypatch.setattr(kserve.model_server, "app", app)
    build_kserve_server(ServeConfig(port=8000), DeadEngineHandle(), "m").create_application()
    with TestClient(app) as client:
        r = client.get("/health")
    assert r.status_code == 503 and "killed by signal 9" in r.json()["reason"]


def test_ray_leaves_a_replica_alone_during_its_last_restart_and_replaces_it_after():
    slow_build = functools.partial(fake_engine_factory, build_s=3.0)
    replica = EngineReplica(ServeConfig(max_engine_restarts=1), factory=slow_build)
    try:
        first = replica.loop.pid
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: replica.restarts == 1, 10)
        assert replica.problem() is not None  # down while the new engine builds
        replica.check_health()  # ... but the replica recovers by itself: Ray must not replace it
        wait_for(lambda: replica.problem() is None, 60)
        replica.check_health()
        os.kill(replica.loop.pid, signal.SIGKILL)  # no restart left: now Ray's turn
        wait_for(lambda: not replica.loop.alive, 10)
        with pytest.raises(RuntimeError, match="killed by signal 9"):
            replica.check_health()
        assert replica.restarts == 1
    finally:
        replica.shutdown()
