"""The engine in its own process (`EngineProcess`): the same contract as the engine thread, plus what a
second process adds: one hand-over per step, engine death, start-up failure, no orphans."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import psutil
import pytest
from dspark.engine.sampling_params import SamplingParams
from dspark.serving.engine_loop import AsyncEngineClient, EngineStopped
from dspark.serving.engine_prestart import (
    PRESTARTED_ENGINE_ENV,
    EngineHello,
    PrestartedEngine,
    adopt,
    environment_differences,
)
from dspark.serving.engine_process import EngineProcess, engine_env
from dspark.serving.metrics import ServingMetrics

from tests.serving.fake_engine import fake_engine_factory
from tests.serving.test_engine_loop import GREEDY, reference

pytestmark = pytest.mark.long

ROOT = Path(__file__).resolve().parents[2]
LONG = SamplingParams(max_tokens=100_000, temperature=0)  # never finishes on its own in a test


def start(**settings) -> EngineProcess:
    settings = {"max_model_len": 200_000, **settings}
    proc = EngineProcess(functools.partial(fake_engine_factory, **settings), None, ServingMetrics("fake"))
    proc.start()
    return proc


@pytest.fixture
def engine():
    proc = start(max_num_seqs=4, step_delay_s=0.005)
    yield proc
    proc.stop(drain_timeout_s=2)


def gauge(proc: EngineProcess, name: str) -> float:
    return getattr(proc.metrics, name).labels("fake")._value.get()


async def settle(proc: EngineProcess, timeout_s: float = 10.0) -> None:
    """Until the engine reports nothing running or waiting."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gauge(proc, "num_running") == 0 and gauge(proc, "num_waiting") == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("requests still in the engine")


async def collect(client: AsyncEngineClient, prompt: list[int], params: SamplingParams = GREEDY):
    ids, last = [], None
    async with client.open(prompt, params) as stream:
        async for out in stream:
            ids += out.new_token_ids
            last = out
    return ids, last


def test_info_carries_what_the_serving_layer_reads(engine):
    info = engine.info
    assert info.model_name == "fake-model" and info.max_model_len == 200_000
    assert info.config.max_num_seqs == 4 and info.tokenizer.decode(info.tokenizer.encode("ab")) == "ab"
    assert engine.alive and engine.pid != os.getpid()


def test_concurrent_requests_match_solo_runs_and_share_steps(engine):
    client = AsyncEngineClient(engine, max_in_flight=32)
    prompts = [[5 + i, 7, 9 + i] for i in range(10)]

    async def main():
        loop = asyncio.get_running_loop()
        hand_overs = []
        original = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            if getattr(callback, "__name__", "") == "deliver_outputs":
                hand_overs.append(len(args[0]))
            return original(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting
        results = await asyncio.gather(*(collect(client, p) for p in prompts))
        return results, hand_overs

    results, hand_overs = asyncio.run(main())
    for p, (ids, last) in zip(prompts, results, strict=True):
        assert ids == reference(p, GREEDY) and last.finish_reason == "length" and len(ids) == 12
    # Every output of a step arrives in one hand-over: 4 requests decode together, so some carry
    # several outputs, and there are far fewer hand-overs than outputs.
    outputs = sum(hand_overs)
    assert max(hand_overs) >= 2 and len(hand_overs) < outputs
    # The step statistics crossed over too: the fake engine verifies 4 tokens per request per step.
    assert engine.metrics.verify_batch.labels("fake")._sum.get() > 0
    assert client.in_flight == 0


def test_bad_input_is_the_engines_value_error(engine):
    client = AsyncEngineClient(engine, max_in_flight=8)

    async def main():
        with pytest.raises(ValueError, match="empty prompt"):
            async with client.open([], GREEDY):
                pass
        assert client.in_flight == 0
        return await collect(client, [1, 2])  # the engine is still fine

    ids, _ = asyncio.run(main())
    assert ids == reference([1, 2], GREEDY) and engine.alive


def test_leaving_early_aborts_and_frees_the_slot(engine):
    client = AsyncEngineClient(engine, max_in_flight=8)

    async def main():
        async with client.open([1, 2, 3], LONG) as stream:
            await anext(stream)
            assert gauge(engine, "num_running") == 1
        await settle(engine)

    asyncio.run(main())
    assert client.in_flight == 0


def test_cancelled_task_aborts_request(engine):
    client = AsyncEngineClient(engine, max_in_flight=8)

    async def main():
        task = asyncio.create_task(collect(client, [4, 4], LONG))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await settle(engine)

    asyncio.run(main())
    assert client.in_flight == 0


def test_stop_drains_running_requests_then_refuses_new_ones():
    proc = start(step_delay_s=0.01)
    outs = []
    proc.add([1, 2, 3], SamplingParams(max_tokens=30, temperature=0), "r1", outs.append).result(timeout=10)
    started = time.monotonic()
    proc.stop(drain_timeout_s=10)
    assert time.monotonic() - started < 5  # it stopped once drained, not at the timeout
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs) == 30
    assert proc._proc.returncode == 0 and not proc.alive
    with pytest.raises(EngineStopped):
        proc.add([1], GREEDY, "r2", outs.append).result(timeout=1)


def test_stop_timeout_aborts_what_is_left():
    proc = start(step_delay_s=0.05)
    outs = []
    proc.add([1, 2], LONG, "r", outs.append).result(timeout=10)
    proc.stop(drain_timeout_s=0.3)
    assert proc._proc.returncode == 0
    assert outs[-1].finished and outs[-1].finish_reason == "abort"


def test_engine_crash_fails_callers_instead_of_hanging():
    proc = start(fail_on_step=True)
    client = AsyncEngineClient(proc, max_in_flight=4)

    async def main():
        async with client.open([1, 2], GREEDY) as stream:
            return [o async for o in stream]

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "error" and "simulated engine failure" in outs[-1].error
    assert not proc.alive and "simulated" in proc.fatal_error

    async def again():
        async with client.open([1, 2], GREEDY):
            pass

    with pytest.raises(EngineStopped, match="simulated"):
        asyncio.run(again())
    proc.stop(1)


def test_a_killed_engine_process_fails_in_flight_requests():
    proc = start(step_delay_s=0.02)
    client = AsyncEngineClient(proc, max_in_flight=4)

    async def main():
        async with client.open([1, 2], LONG) as stream:
            await anext(stream)
            os.kill(proc.pid, signal.SIGKILL)
            return [o async for o in stream]

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "error"
    assert (
        outs[-1].error == proc.fatal_error == "engine failure: the engine process exited (killed by signal 9)"
    )
    assert not proc.alive
    with pytest.raises(EngineStopped, match="killed by signal 9"):
        proc.add([1], GREEDY, "r2", print).result(timeout=1)
    proc.stop(1)


def test_start_up_failure_is_raised_with_the_engines_message():
    with pytest.raises(RuntimeError, match=r"engine start-up failed: .*unexpected keyword argument 'gpus'"):
        EngineProcess(functools.partial(fake_engine_factory, gpus=8), None)


def _replica(body: str, **popen: object) -> subprocess.Popen:
    """A stand-in replica: a Python process that runs `body` with EngineProcess and the fake engine
    factory imported."""
    script = (
        "import functools, sys, time\n"
        "from dspark.serving.engine_process import EngineProcess\n"
        "from tests.serving.fake_engine import fake_engine_factory\n"
    ) + body
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "service"), str(ROOT)])}
    return subprocess.Popen([sys.executable, "-c", script], **{"env": env, **popen})


def test_the_engine_process_dies_with_its_replica(tmp_path):
    """A replica killed outright (no shutdown) leaves no engine process behind."""
    replica = _replica(
        "proc = EngineProcess(fake_engine_factory, None)\n"
        "proc.start()\n"
        "print(proc.pid, flush=True)\n"
        "time.sleep(600)\n",
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        child = psutil.Process(int(replica.stdout.readline()))
        assert child.is_running() and child.ppid() == replica.pid
        replica.kill()
        replica.wait(10)
        child.wait(10)  # raises TimeoutExpired if the engine outlived its replica
    finally:
        replica.kill()
        replica.wait()


def test_an_engine_still_building_dies_with_its_replica(tmp_path):
    """Loading and compiling take minutes without a look at the pipe: a replica killed meanwhile
    (Ctrl-C at start-up, a failed health check) must not leave the build running."""
    marker = tmp_path / "building"
    replica = _replica(
        f"EngineProcess(functools.partial(fake_engine_factory, build_s=600, building_marker={str(marker)!r}), None)\n"
    )
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), "the engine never started building"
        children = psutil.Process(replica.pid).children()
        replica.kill()
        replica.wait(10)
        children[0].wait(10)  # raises TimeoutExpired if the build outlived its replica
    finally:
        replica.kill()
        replica.wait()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


# The engine process `dspark serve` prestarts (engine_prestart) ---------------------------------------
def test_a_prestarted_engine_is_taken_over_by_the_first_engine_process_only(monkeypatch):
    prestarted = PrestartedEngine(engine_env(None))
    monkeypatch.setenv(PRESTARTED_ENGINE_ENV, str(prestarted.path))
    first = second = None
    try:
        first = start(max_num_seqs=2)
        assert first.pid == prestarted.pid  # the prestarted process, not a spawned one
        client = AsyncEngineClient(first, max_in_flight=4)
        ids, last = asyncio.run(collect(client, [3, 1, 4]))
        assert ids == reference([3, 1, 4], GREEDY) and last.finish_reason == "length"
        second = start()  # a restart, or a second replica: the socket is gone, it spawns its own
        assert second.pid not in (prestarted.pid, os.getpid()) and second.alive
        first.stop(drain_timeout_s=2)
        assert prestarted.wait(10) == 0  # stopped as a spawned engine stops
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.stop(drain_timeout_s=0)
        prestarted.close()


def test_a_taken_over_engine_still_building_dies_with_its_replica(tmp_path):
    """Not the replica's child, it watches the replica's pid while it builds."""
    marker = tmp_path / "building"
    replica_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "service"), str(ROOT)])}
    prestarted = PrestartedEngine(engine_env(None, replica_env))
    replica = _replica(
        f"EngineProcess(functools.partial(fake_engine_factory, build_s=600, building_marker={str(marker)!r}), None)\n",
        env={**replica_env, PRESTARTED_ENGINE_ENV: str(prestarted.path)},
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), "the engine never started building"
        assert not psutil.Process(replica.pid).children()  # it took the prestarted one over
        replica.kill()
        replica.wait(10)
        assert prestarted.wait(10) == 0  # raises TimeoutExpired if the build outlived its replica
    finally:
        replica.kill()
        replica.wait()
        prestarted.close()


def test_a_prestarted_engine_in_another_environment_is_not_taken_over(tmp_path, monkeypatch):
    """It would run the engine with other settings than the replica's own (another CPU pinning,
    another device list): the replica closes the connection and spawns its engine as usual."""
    expected = engine_env(None)
    path = tmp_path / "engine.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    closed = threading.Event()

    def prestarted_engine() -> None:
        sock, _ = listener.accept()
        conn = Connection(sock.detach())
        conn.send(EngineHello(1, {**expected, "GOMP_CPU_AFFINITY": "7", "RAY_JOB_ID": "01"}, os.getcwd()))
        with contextlib.suppress(EOFError):
            conn.recv()
        closed.set()

    threading.Thread(target=prestarted_engine, daemon=True).start()
    monkeypatch.setenv(PRESTARTED_ENGINE_ENV, str(path))
    assert adopt(expected) is None
    assert closed.wait(10)
    # Ray's per-process variables aside, nothing may differ.
    assert environment_differences(expected, {**expected, "RAY_JOB_ID": "01"}) == []
    assert environment_differences(expected, {**expected, "GOMP_CPU_AFFINITY": "7"}) == ["GOMP_CPU_AFFINITY"]
    listener.close()
