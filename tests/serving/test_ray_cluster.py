"""On a real multi-node Ray cluster (three raylets on loopback, custom resources standing for node
types): `dspark serve --address`, the RayService import path, and replicas placed by node type.

One cluster for the module: a head with no replica slots, and a worker of each of two node types
with one slot each. Serve runs on it with one HTTP proxy, on the head (as the head of a KubeRay
RayService would), before any test deploys onto it. The placement tests use the fake engine; the
command line and the import path serve a real engine over a tiny model.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from dspark.node_resources import node_resources
from dspark.serving.config import ServeConfig
from dspark.serving.deployment import APP_NAME, openai_app

from tests.conftest import write_tiny_model
from tests.serving.fake_engine import node_recording_factory
from tests.serving.live_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.real_server]
NODE = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 80 * 1024**2}
TYPES = ("cpu-small", "cpu-large")


class LocalCluster:
    """The Ray cluster, its worker node of each type, and Serve's proxy URL on the head."""

    def __init__(self, tmp: Path):
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
        self.workers = {t: self.add_worker(t) for t in TYPES}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.profiles = {}
        for t in TYPES:
            self.profiles[t] = tmp / f"{t}.json"
            self.profiles[t].write_text(f"the profile of {t}")

    def add_worker(self, node_type: str):
        return self.cluster.add_node(**NODE, resources=node_resources(node_type, 1))

    def node_types(self) -> dict[str, str]:
        """Node id -> node type of every live worker node."""
        return {node.node_id: t for t, node in self.workers.items()}


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """The cluster, with this process connected as a driver and Serve started on the head only.

    RAY_TMPDIR keeps the cluster's files, and the address file through which a bare `ray.init()`
    would join it, away from the Ray instances other tests start in-process. Ray on Linux takes
    127.0.0.1 in an address for this machine's outward IP, where nothing of this cluster listens;
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps loopback as the node address (read when Ray is
    imported: this process, which imported it already, gets the constant itself).
    """
    import ray
    from ray import serve
    from ray._private import ray_constants

    tmp = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))  # Unix socket paths must stay short
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_TMPDIR", str(tmp))
        env.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        env.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        local = LocalCluster(tmp_path_factory.mktemp("profiles"))
        try:
            ray.init(address=local.cluster.address)
            serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": local.port})
            yield local
        finally:
            serve.shutdown()
            ray.shutdown()
            local.cluster.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)


def wait_for(condition, timeout_s: float = 120, what: str = "the condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.25)
    raise TimeoutError(f"timed out waiting for {what}")


def replicas_by_node(app: str = APP_NAME, deployment: str | None = None) -> dict[str, str]:
    """Replica id -> node id of the app's running replicas (of one deployment, or all of them);
    Serve's controller knows where they are."""
    from ray.serve.context import _get_global_client

    apps = _get_global_client().get_serve_details().get("applications", {})
    deployments = apps[app]["deployments"] if app in apps else {}
    return {
        r["replica_id"]: r["node_id"]
        for name, d in deployments.items()
        if deployment in (None, name)
        for r in d["replicas"]
        if r["state"] == "RUNNING"
    }


def starts(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def complete(url: str, model: str, **body) -> httpx.Response:
    request = {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/completions", json=request, timeout=60)


def test_replicas_go_to_their_node_types_and_come_back_after_a_node_dies(ray_cluster, tmp_path):
    """Two replicas: the engine deployment behind the HTTP ingress (which takes no slot)."""
    from ray import serve

    def engines() -> dict[str, str]:
        return replicas_by_node(deployment="EngineBackend")

    log = tmp_path / "starts.jsonl"
    config = ServeConfig(
        num_replicas=2,
        sps_profiles=ray_cluster.profiles,
        engine_in_thread=True,
        max_output_tokens=16,
        graceful_shutdown_timeout_s=1,
    )
    serve.run(openai_app(config, functools.partial(node_recording_factory, log=str(log))), name=APP_NAME)
    try:
        types = ray_cluster.node_types()
        placed = wait_for(lambda: r if len(r := engines()) == 2 else None, what="2 engine replicas")
        assert sorted(types[node] for node in placed.values()) == sorted(TYPES)  # none on the head
        assert len(starts(log)) == 2
        for start in starts(log):
            node_type = types[start["node_id"]]
            assert start["sps_profile"] == str(ray_cluster.profiles[node_type])
            assert start["profile_text"] == f"the profile of {node_type}"
        assert complete(ray_cluster.url, "fake-model").status_code == 200

        dead = ray_cluster.workers["cpu-small"]
        ray_cluster.cluster.remove_node(dead)
        ray_cluster.workers["cpu-small"] = fresh = ray_cluster.add_worker("cpu-small")

        def back_on_the_fresh_node():
            nodes = set(engines().values())
            return len(nodes) == 2 and fresh.node_id in nodes

        wait_for(back_on_the_fresh_node, what="the replica on the fresh cpu-small node")
        assert dead.node_id not in set(engines().values())
        fresh_starts = [s for s in starts(log) if s["node_id"] == fresh.node_id]
        assert [s["profile_text"] for s in fresh_starts] == ["the profile of cpu-small"]
        # The ingress takes no slot and may have been on the removed node too: it comes back as well.
        wait_for(lambda: complete(ray_cluster.url, "fake-model").status_code == 200, what="a 200")
    finally:
        serve.delete(APP_NAME)


@pytest.fixture(scope="module")
def tiny_target(smollm_dir, tmp_path_factory) -> dict[str, str]:
    """Settings of a real engine over a tiny random model (SmolLM2's tokenizer), cheap to load; on
    the replica's thread, which spares a process start (the engine process has tests of its own)."""
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(smollm_dir))
    path = write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=1, vocab_size=vocab)
    return {
        "target": str(path),
        "tokenizer": str(smollm_dir),
        "served_model_name": "tiny",
        "device": "cpu",
        "dtype": "float32",
        "compile": False,
        "drafter": "ngram",
        "policy": "static:4",
        "max_model_len": 128,
        "max_output_tokens": 16,
        "num_cpus_per_replica": 1,
        "engine_in_thread": True,
        "graceful_shutdown_timeout_s": 1,
    }


def test_dspark_serve_address_deploys_onto_the_cluster_and_leaves_it_running(ray_cluster, tiny_target):
    import ray
    from ray import serve

    env = {
        **os.environ,
        **{
            f"DSPARK_{name.upper()}": str(v).lower() if isinstance(v, bool) else str(v)
            for name, v in tiny_target.items()
        },
    }
    address = ray_cluster.cluster.address
    cli = [sys.executable, "-m", "dspark.cli", "serve", "--address", address]
    proc = subprocess.Popen(cli, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def answered() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"dspark serve exited: {proc.stdout.read()}")
        return bool(replicas_by_node()) and complete(ray_cluster.url, "tiny").status_code == 200

    try:
        wait_for(answered, timeout_s=240, what="the application of dspark serve --address")
    finally:
        # SIGTERM, as Kubernetes stops a pod: a process started in the background ignores SIGINT.
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert f"joining the Ray cluster at {address}" in output and "stopped" in output
    # Deleted: the controller drops a deleted application from its status on its next pass.
    wait_for(lambda: APP_NAME not in serve.status().applications, timeout_s=30, what="the app's deletion")
    assert sum(node["Alive"] for node in ray.nodes()) == 3  # the cluster keeps running
    assert complete(ray_cluster.url, "tiny").status_code == 404  # its proxy too, with no route now


def test_the_rayservice_import_path_serves_the_same_app(ray_cluster, tiny_target):
    """Deployed as KubeRay deploys a RayService's serveConfigV2: the controller imports the builder
    and calls it with `args`, on the cluster."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    serve_config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": ray_cluster.port},
        "applications": [
            {
                "name": "tier-standard",
                "route_prefix": "/",
                "import_path": "dspark.serving.app:build_app",
                "args": tiny_target,
            }
        ],
    }
    client = _get_global_client()
    client.deploy_apps(ServeDeploySchema.model_validate(serve_config))
    try:
        wait_for(lambda: replicas_by_node("tier-standard"), timeout_s=240, what="the RayService app")
        reply = complete(ray_cluster.url, "tiny")
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        assert complete(ray_cluster.url, "tiny", max_tokens=-1).status_code == 400
    finally:
        client.delete_all_apps()
