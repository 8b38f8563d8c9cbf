"""A dead or stopped engine process under load, against the real server (real engine, Ray Serve on
loopback, the engine in its own process): in-flight requests get 503 within 10 s, `/health`
answers 503, and the server answers 200 again within 60 s."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.serving.live_server import API_KEY, LiveServer, start

pytestmark = [pytest.mark.slow, pytest.mark.real_server]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
STALL_TIMEOUT_S = 5.0
# Long enough to be in flight when the signal comes, whatever the CPU.
LONG = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    from dspark.serving.runtime import shutdown

    live = start("ray", engine_stall_timeout_s=STALL_TIMEOUT_S, max_output_tokens=400)
    try:
        yield live
    finally:
        live.stop()
        shutdown()


def engine_pid() -> int:
    """The engine process of this test's server: a descendant of this process (Ray's, not another's)."""
    pids = [
        p.pid
        for p in psutil.Process().children(recursive=True)
        if "dspark.serving.engine_core" in " ".join(_cmdline(p))
    ]
    assert len(pids) == 1, pids
    return pids[0]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


class Load:
    """Streamed and plain requests in flight, each recording when and how it ended."""

    def __init__(self, server: LiveServer, streams: int = 3, plain: int = 2):
        self.url = server.openai_base + "/completions"
        self.body = {**LONG, "model": server.model}
        self.started = threading.Semaphore(0)
        self.results: list[tuple[str, float, int, str, dict]] = []  # kind, end, status, last text, headers
        self.threads = [threading.Thread(target=self._stream) for _ in range(streams)]
        self.threads += [threading.Thread(target=self._plain) for _ in range(plain)]
        for t in self.threads:
            t.start()

    def _stream(self) -> None:
        error = ""
        with httpx.stream(
            "POST", self.url, json={**self.body, "stream": True}, headers=AUTH, timeout=120
        ) as r:
            for i, line in enumerate(r.iter_lines()):
                if i == 0:
                    self.started.release()
                if line and "[DONE]" not in line:
                    error = line
            self.results.append(("stream", time.monotonic(), r.status_code, error, dict(r.headers)))

    def _plain(self) -> None:
        r = httpx.post(self.url, json=self.body, headers=AUTH, timeout=120)
        self.results.append(("plain", time.monotonic(), r.status_code, r.text, dict(r.headers)))

    def wait_streaming(self, n: int) -> None:
        for _ in range(n):
            assert self.started.acquire(timeout=120), "the streams never started"

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a request hangs"


class HealthWatch:
    """Polls `/health` from now on; `saw_503` once it answered 503."""

    def __init__(self, server: LiveServer):
        self.url = server.base + "/health"
        self.saw_503 = threading.Event()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll)
        self.thread.start()

    def _poll(self) -> None:
        while not self.done.is_set():
            try:
                if httpx.get(self.url, timeout=5).status_code == 503:
                    self.saw_503.set()
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(10)


def serves_again_within(server: LiveServer, since: float, timeout_s: float) -> float:
    """Seconds from `since` until a completion answers 200."""
    body = {"model": server.model, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    while time.monotonic() - since < timeout_s:
        try:
            r = httpx.post(server.openai_base + "/completions", json=body, headers=AUTH, timeout=30)
            if r.status_code == 200 and httpx.get(server.base + "/health", timeout=5).status_code == 200:
                return time.monotonic() - since
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the server did not serve again within {timeout_s} s")


def check_in_flight_failed(load: Load, since: float, within_s: float) -> None:
    load.join(within_s + 30)  # a hang fails here; the deadline is checked on the recorded ends
    assert len(load.results) == len(load.threads)
    for kind, end, status, last, headers in load.results:
        assert end - since < within_s, f"{kind} request ended {end - since:.1f} s after the signal"
        if kind == "plain":
            assert status == 503 and int(headers["retry-after"]) >= 1, (status, last)
        else:  # the stream's 200 went out before the engine died: the error is its last event
            assert status == 200 and '"code":503' in last, last


@pytest.mark.parametrize(
    "sig, within_s",
    [(signal.SIGKILL, 10.0), (signal.SIGSTOP, STALL_TIMEOUT_S + 10.0)],
    ids=["SIGKILL", "SIGSTOP"],
)
def test_a_dead_or_stopped_engine_under_load_is_replaced(server, sig, within_s):
    load = Load(server)
    load.wait_streaming(3)
    pid = engine_pid()
    health = HealthWatch(server)
    killed_at = time.monotonic()
    os.kill(pid, sig)
    try:
        check_in_flight_failed(load, killed_at, within_s)
        assert health.saw_503.wait(30), "/health never answered 503"
        took = serves_again_within(server, killed_at, 60)
    finally:
        health.stop()
        if sig == signal.SIGSTOP and psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)  # the server should have; never leave it behind
    assert engine_pid() != pid
    print(f"{sig.name}: serving again {took:.1f} s after the signal")
