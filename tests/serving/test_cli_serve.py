"""`dspark serve` as a user runs it: the documented curl request works, the official client's
structured-output parse() with a pydantic model works, SIGTERM drains and cleans up."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from pydantic import BaseModel, Field

from tests.serving.live_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.real_server]
ROOT = Path(__file__).resolve().parents[2]


def documented_curl(doc: str, port: int) -> list[str]:
    """The first curl request in a document, aimed at this test's port."""
    text = (ROOT / doc).read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if b.lstrip().startswith("curl"))
    return shlex.split(block.replace("\\\n", " ").replace("localhost:8000", f"127.0.0.1:{port}"))


def serve_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "service"), str(ROOT / "operator")])}
    env.pop("DSPARK_API_KEY", None)
    return env


@pytest.fixture(scope="module")
def served():
    port = free_port()
    env = serve_env()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dspark.cli",
            "serve",
            "--port",
            str(port),
            "--max-num-seqs",
            "4",
            "--dtype",
            "float32",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise AssertionError(
                f"server did not come up: {proc.stdout.read() if proc.poll() is not None else ''}"
            )
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.mark.parametrize("doc", ["README.md", "docs/serving.md"])
def test_documented_curl_returns_generated_text(served, doc):
    _, port = served
    out = subprocess.run(
        documented_curl(doc, port), capture_output=True, text=True, timeout=120, check=True
    ).stdout
    reply = json.loads(out)
    assert reply["choices"][0]["message"]["content"].strip()
    assert reply["usage"]["completion_tokens"] > 0


class City(BaseModel):
    name: str = Field(min_length=1, max_length=24)
    country: str = Field(min_length=1, max_length=24)
    population_millions: int = Field(ge=0, le=100)


def test_openai_parse_with_a_pydantic_model(served):
    _, port = served
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
    )
    completion = client.beta.chat.completions.parse(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Give me a famous city as JSON."}],
        response_format=City,
        max_tokens=100,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    city = choice.message.parsed
    assert isinstance(city, City), choice.message.content
    assert City.model_validate_json(choice.message.content) == city
    assert city.name.strip() and city.country.strip() and 0 <= city.population_millions <= 100


def _listens_on(process: psutil.Process, port: int) -> bool:
    try:
        return any(
            c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in process.connections("tcp")
        )
    except psutil.NoSuchProcess:  # one of Ray's short-lived helpers, gone since it was listed
        return False


def test_one_replica_listens_on_the_port_itself(served):
    proc, port = served
    listeners = [
        " ".join(p.cmdline())
        for p in psutil.Process(proc.pid).children(recursive=True)
        if _listens_on(p, port)
    ]
    # Direct ingress: the replica's own server, not Ray's proxy actor, holds the port.
    assert len(listeners) == 1 and "ServeReplica" in listeners[0], listeners


def test_a_second_server_on_a_taken_port_is_refused_before_loading(served):
    _, port = served
    cmd = [sys.executable, "-m", "dspark.cli", "serve", "--port", str(port)]
    r = subprocess.run(cmd, cwd=ROOT, env=serve_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and f"cannot serve on 127.0.0.1:{port}" in r.stderr, r.stderr[-2000:]


def test_readme_starts_with_the_serve_command():
    first_block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    assert first_block.split()[:2] == ["make", "serve"]
    assert "dspark serve" in (ROOT / "Makefile").read_text()


def test_the_one_engine_process_is_the_one_the_driver_prestarted(served):
    """Started before Ray and taken over by the replica: no second engine was spawned."""
    proc, port = served
    engines = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "dspark.serving.engine_core" in child.cmdline():
                engines.append(child)
    assert len(engines) == 1
    assert engines[0].ppid() == proc.pid and "--listen" in engines[0].cmdline()
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200


def test_sigterm_drains_in_flight_stream_and_leaves_nothing_running(served):
    proc, port = served
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children  # Ray's processes
    events: list[str] = []
    first = threading.Event()

    def stream() -> None:
        body = {
            "model": "smollm2-135m",
            "prompt": "Once upon a time",
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(120)
    proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert events[-1] == "data: [DONE]", events[-3:]
    finishes = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finishes[-1] == "length"
    assert proc.wait(120) == 0
    # The defaults served the shipped DSpark drafter under the DSpark scheduler, with its profile.
    assert "drafter dspark, policy dspark" in proc.stdout.read()
    time.sleep(2)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
