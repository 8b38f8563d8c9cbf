"""`dspark serve HUB_ID --speculative-config ...` as a vLLM user starts it: the target and the DSpark
drafter come from a loopback hub (tests/hub_emulator.py) into a fresh hub cache, the server answers
under the hub id, and the cache then serves the same snapshots with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from dspark.drafters.factory import checkpoint_dir
from dspark.drafters.shipped import SHIPPED_ROOT
from dspark.models.pull import resolve_target
from dspark.serving.config import load_config
from dspark.serving.launcher import prepare_model

from tests.hub_emulator import HubEmulator, repo_from_dir
from tests.serving.live_server import free_port
from tests.serving.test_cli_serve import ROOT, serve_env

pytestmark = [pytest.mark.slow, pytest.mark.real_server]
TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"
DRAFTER = "dspark-org/smollm2-135m-dspark-block7"
SPEC = json.dumps({"method": "dspark", "model": DRAFTER, "num_speculative_tokens": 7})


def wait_ready(proc: subprocess.Popen, port: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)
    output = proc.stdout.read() if proc.poll() is not None else ""
    raise AssertionError(f"server did not come up: {output}")


def test_hub_target_and_drafter_served_under_the_hub_id_then_offline(smollm_dir, tmp_path, monkeypatch):
    repos = {
        TARGET: repo_from_dir(smollm_dir, skip=("dspark-model.json",)),
        DRAFTER: repo_from_dir(SHIPPED_ROOT / "smollm2-135m" / "dspark"),
    }
    args = ["serve", TARGET, "--speculative-config", SPEC, "--policy", "static:7", "--dtype", "float32"]
    args += ["--max-num-seqs", "2", "--max-model-len", "512"]
    env = {**serve_env(), "HF_HOME": str(tmp_path / "hf"), "DSPARK_HOME": str(tmp_path / "dspark")}
    for name in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        env.pop(name, None)
    port = free_port()
    with HubEmulator(repos) as hub:
        env["HF_ENDPOINT"] = hub.endpoint
        proc = subprocess.Popen(
            [sys.executable, "-m", "dspark.cli", *args, "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            wait_ready(proc, port)
            base = f"http://127.0.0.1:{port}/v1"
            assert [m["id"] for m in httpx.get(f"{base}/models").json()["data"]] == [TARGET]
            body = {
                "model": TARGET,
                "messages": [{"role": "user", "content": "Count from one to ten."}],
                "max_tokens": 24,
                "temperature": 0,
                "return_spec_stats": True,
            }
            reply = httpx.post(f"{base}/chat/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            data = reply.json()
            assert data["model"] == TARGET and data["choices"][0]["message"]["content"].strip()
            stats = data["spec_decode_stats"]
            assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] > 0, stats
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        downloaded = hub.file_downloads()
    assert any(p.startswith(f"/{TARGET}/resolve/") and p.endswith("model.safetensors") for p in downloaded)
    assert any(p.startswith(f"/{DRAFTER}/resolve/") and p.endswith("model.safetensors") for p in downloaded)
    # The hub is gone; offline, the server's start-up resolution finds both in the cache.
    monkeypatch.setenv("HF_HOME", env["HF_HOME"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    snapshots = tmp_path / "hf" / "hub"
    assert resolve_target(TARGET).is_relative_to(snapshots / "models--HuggingFaceTB--SmolLM2-135M-Instruct")
    assert checkpoint_dir(DRAFTER).is_relative_to(
        snapshots / "models--dspark-org--smollm2-135m-dspark-block7"
    )
    prepare_model(load_config(None, {"target": TARGET, "drafter": DRAFTER}, environ={}))
