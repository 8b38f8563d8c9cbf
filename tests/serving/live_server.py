"""Start the real server (real engine, Ray Serve on loopback) in either front end, for acceptance tests."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import httpx
from dspark.bench.peer import free_port  # below the ephemeral range: Ray's connections draw from it
from dspark.serving.config import ServeConfig

API_KEY = "test-key"


def test_config(port: int, kserve: bool) -> ServeConfig:
    """Small limits so that any accepted request stays cheap on a CPU. The standalone front end runs
    the engine in its own process (the default), the KServe one on the replica's thread, so the
    real server covers both (the replica code under either front end is the same)."""
    return ServeConfig(
        port=port,
        kserve=kserve,
        engine_in_thread=kserve,
        api_key=API_KEY,
        dtype="float32",
        device="cpu",
        max_num_seqs=16,
        max_model_len=512,
        max_queue=4,
        max_output_tokens=64,
        drafter="ngram",
        policy="static:4",
        graceful_shutdown_timeout_s=5,
    )


@dataclass
class LiveServer:
    mode: str
    base: str  # scheme://host:port
    openai_base: str  # where the OpenAI routes live
    model: str
    stop: object


def _wait_ready(url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server at {url} did not become ready")


def start(mode: str, **overrides) -> LiveServer:
    """The server in `mode` ("ray" or "kserve"), with `overrides` of `test_config`'s settings."""
    from dspark.serving.runtime import run_openai_server, start_ray
    from ray import serve

    port = free_port()
    config = test_config(port, kserve=(mode == "kserve")).model_copy(update=overrides)
    start_ray(num_cpus=2)
    base = f"http://127.0.0.1:{port}"
    if mode == "ray":
        run_openai_server(config)
        _wait_ready(base + "/ready")
        return LiveServer(mode, base, base + "/v1", "smollm2-135m", serve.shutdown)

    from dspark.serving.kserve_model import build_kserve_server, deploy_engine_backend

    handle, name = deploy_engine_backend(config)
    rest = build_kserve_server(config, handle, name)
    thread = threading.Thread(target=lambda: asyncio.run(rest.start()), name="kserve-rest", daemon=True)
    thread.start()
    _wait_ready(base + "/ready")

    def stop() -> None:
        rest._server.should_exit = True
        thread.join(timeout=30)
        serve.shutdown()

    return LiveServer(mode, base, base + "/openai/v1", name, stop)
