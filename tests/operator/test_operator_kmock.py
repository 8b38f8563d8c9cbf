"""The real kopf operator against kmock's in-memory Kubernetes.

The test plays the cluster's other controllers: the Job controller (a profiling pod whose log
holds the profile, then the Job's status), the kubelet (ready serving pods) and the garbage
collector (ClusterEmulator cascades along ownerReferences). Serving pods' /metrics come from a
local HTTP server whose per-user speed and TTFT the test dials up and down.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kopf
import kopf.testing
import pytest
from cluster_emulator import EmulatedCluster
from dspark.sps_format import PROFILE_BEGIN, PROFILE_END
from dspark_operator import handlers
from dspark_operator.kube import Kube, load_client_configuration
from operator_fixtures import profile_json, service
from prometheus_client import REGISTRY, CollectorRegistry, Gauge, Histogram, generate_latest

NS = "default"
CRS = "/apis/dspark.ai/v1alpha1/namespaces/default/dsparkservices"
logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


class FakeServingMetrics:
    """A serving pod's /metrics: every scrape records a batch of requests at the dialled values."""

    def __init__(self) -> None:
        self.tokens_per_second, self.ttft, self.running = 50.0, 0.2, 2.0
        self.lock = threading.Lock()
        self.registry = CollectorRegistry()
        self.tps_hist = Histogram(
            "dspark_request_tokens_per_second",
            "",
            registry=self.registry,
            buckets=(5, 10, 20, 30, 40, 50, 60, 80, 100, 150),
        )
        self.ttft_hist = Histogram(
            "vllm:time_to_first_token_seconds",
            "",
            registry=self.registry,
            buckets=(0.1, 0.25, 0.5, 1, 2, 4, 8),
        )
        self.running_gauge = Gauge("vllm:num_requests_running", "", registry=self.registry)
        Gauge("vllm:num_requests_waiting", "", registry=self.registry).set(0)

    def dial(self, tokens_per_second: float, ttft: float, running: float) -> None:
        with self.lock:
            self.tokens_per_second, self.ttft, self.running = tokens_per_second, ttft, running

    def scrape(self) -> bytes:
        with self.lock:
            for _ in range(20):
                self.tps_hist.observe(self.tokens_per_second)
                self.ttft_hist.observe(self.ttft)
            self.running_gauge.set(self.running)
            return generate_latest(self.registry)


@contextlib.contextmanager
def metrics_server(fake: FakeServingMetrics, paths: set[str] | None = None) -> Iterator[int]:
    """A local HTTP server answering every GET with a scrape of `fake` (the path asked goes into
    `paths`); yields its port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if paths is not None:
                paths.add(self.path)
            body = fake.scrape()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        thread.join()


@pytest.fixture()
def serving_metrics() -> Iterator[tuple[FakeServingMetrics, int]]:
    fake = FakeServingMetrics()
    with metrics_server(fake) as port:
        yield fake, port


def connect_kube(emulated: EmulatedCluster, kubeconfig: Path, env: pytest.MonkeyPatch) -> Kube:
    """A client of the emulated cluster through a kubeconfig, as the operator connects, and the
    cluster's three GPU nodes."""
    kubeconfig.write_text(emulated.kubeconfig())
    env.setenv("KUBECONFIG", str(kubeconfig))
    env.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    load_client_configuration()
    kube = Kube.from_default_configuration()
    for i, gpu in enumerate(["NVIDIA-H200", "NVIDIA-L40S", "Tesla-T4"]):
        kube.create(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": f"gpu-{i}", "labels": {"nvidia.com/gpu.product": gpu}},
            }
        )
    return kube


@pytest.fixture()
def cluster(tmp_path, monkeypatch) -> Iterator[tuple[EmulatedCluster, Kube]]:
    with EmulatedCluster() as emulated:
        yield emulated, connect_kube(emulated, tmp_path / "kubeconfig.yaml", monkeypatch)


@contextlib.contextmanager
def run_operator() -> Iterator[kopf.testing.KopfRunner]:
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = True
    args = ["run", "--standalone", "--namespace", NS, "-m", "dspark_operator.handlers"]
    with kopf.testing.KopfRunner(args, settings=settings) as runner:
        yield runner
    assert runner.exception is None, runner.output[-3000:]


@pytest.fixture()
def operator_running(cluster) -> Iterator[kopf.testing.KopfRunner]:
    with run_operator() as runner:
        yield runner


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last value {value!r}")


def status(kube: Kube) -> dict[str, Any]:
    return kube._call("GET", f"{CRS}/chat").get("status") or {}


def tier_at(kube: Kube, desired: int, tier: str = "interactive") -> dict[str, Any] | None:
    """The tier's status once it records `desired` replicas, else None."""
    found = (status(kube).get("tiers") or {}).get(tier) or {}
    return found if found.get("desiredReplicas") == desired else None


def jobs_for(kube: Kube, gpu_slug: str) -> list[dict]:
    return [j for j in kube.list("Job", NS) if gpu_slug in j["metadata"]["name"]]


def finish_profiling_job(emulated: EmulatedCluster, kube: Kube, job: dict, log: str) -> None:
    """What the Job controller and kubelet would do: a succeeded pod with a log, then Job status."""
    name = job["metadata"]["name"]
    pod = f"{name}-x7k2p"
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod, "namespace": NS, "labels": {"job-name": name}},
            "spec": job["spec"]["template"]["spec"],
            "status": {"phase": "Succeeded"},
        }
    )
    emulated.pod_logs[pod] = log
    kube.patch(
        "Job", NS, name, {"status": {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}}
    )


def replicas(kube: Kube, tier: str) -> int:
    return kube.get("Deployment", NS, f"chat-{tier}")["spec"]["replicas"]


def test_service_profiles_deploys_scales_and_cleans_up(cluster, operator_running, serving_metrics):
    emulated, kube = cluster
    fake, metrics_port = serving_metrics
    kube._call("POST", CRS, body=service())

    # One profiling Job per allowed node type present (not for Tesla-T4), pinned to that type.
    h200 = wait_for("H200 profiling job", lambda: jobs_for(kube, "nvidia-h200"))[0]
    l40s = wait_for("L40S profiling job", lambda: jobs_for(kube, "nvidia-l40s"))[0]
    assert len(kube.list("Job", NS)) == 2
    assert h200["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert h200["spec"]["backoffLimit"] == 0
    command = h200["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "dspark profile" in command[2] and PROFILE_BEGIN in command[2]
    assert h200["metadata"]["ownerReferences"][0]["kind"] == "DSparkService"

    # H200 succeeds: the profile lands in a ConfigMap, tiers deploy there with it mounted.
    finish_profiling_job(
        emulated, kube, h200, f"loading...\n{PROFILE_BEGIN}\n{profile_json()}\n{PROFILE_END}\n"
    )
    cm = wait_for(
        "profile ConfigMap",
        lambda: (
            kube.get("ConfigMap", NS, status(kube)["profiles"]["NVIDIA-H200"]["configMap"])
            if status(kube).get("profiles", {}).get("NVIDIA-H200", {}).get("state") == "Ready"
            else None
        ),
    )
    assert '"points"' in cm["data"]["profile.json"]
    deployment = wait_for("interactive deployment", lambda: kube.get("Deployment", NS, "chat-interactive"))
    pod_spec = deployment["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert pod_spec["volumes"][0]["configMap"]["name"] == cm["metadata"]["name"]
    assert {"name": "DSPARK_SPS_PROFILE", "value": "/etc/dspark/profile/profile.json"} in pod_spec[
        "containers"
    ][0]["env"]
    assert deployment["spec"]["replicas"] == 1
    assert wait_for("batch deployment", lambda: kube.get("Deployment", NS, "chat-batch"))
    assert kube.get("Service", NS, "chat-interactive")["spec"]["selector"]["dspark.ai/tier"] == "interactive"
    assert wait_for("H200 job cleaned up", lambda: not jobs_for(kube, "nvidia-h200"))

    # L40S fails twice: one retry after the backoff, then Failed in status, no third Job.
    kube.patch("Job", NS, l40s["metadata"]["name"], {"status": {"failed": 1}})
    wait_for("L40S retry state", lambda: status(kube)["profiles"]["NVIDIA-L40S"]["state"] == "Retrying")
    retry = wait_for(
        "L40S second attempt",
        lambda: [j for j in jobs_for(kube, "nvidia-l40s") if j["metadata"]["name"].endswith("-2")],
    )[0]
    kube.patch("Job", NS, retry["metadata"]["name"], {"status": {"failed": 1}})
    failed = wait_for(
        "L40S failed",
        lambda: (
            status(kube)["profiles"]["NVIDIA-L40S"]
            if status(kube)["profiles"]["NVIDIA-L40S"]["state"] == "Failed"
            else None
        ),
    )
    assert failed["attempts"] == 2 and "2 attempts in a row failed" in failed["message"]
    time.sleep(1.5)  # longer than the backoff, far shorter than failedRetrySeconds: still no new Job
    assert jobs_for(kube, "nvidia-l40s") == []
    assert status(kube)["phase"] == "Degraded"

    # A ready serving pod of the interactive tier; metrics below target scale it up to max.
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "chat-interactive-abc",
                "namespace": NS,
                "labels": {"dspark.ai/service": "chat", "dspark.ai/tier": "interactive"},
            },
            "spec": {
                "containers": [{"name": "dspark", "ports": [{"name": "http", "containerPort": metrics_port}]}]
            },
            "status": {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }
    )
    fake.dial(tokens_per_second=15, ttft=0.3, running=4)
    wait_for("scale up to 2", lambda: replicas(kube, "interactive") == 2)
    wait_for("scale up to max 4", lambda: replicas(kube, "interactive") == 4)
    tier = wait_for("status of the scale-up", lambda: tier_at(kube, desired=4))
    assert "per-user p50" in tier["lastDecision"]
    assert wait_for("ScaledUp events", lambda: len(events(kube, "ScaledUp")) >= 2)
    last_up = tier["lastScaleTime"]
    assert (
        REGISTRY.get_sample_value(
            "dspark_desired_replicas",
            {"dspark_namespace": NS, "dspark_service": "chat", "dspark_tier": "interactive"},
        )
        == 4
    )

    # Comfortably above target and idle: scale down to min, but only after the 3 s cool-down.
    fake.dial(tokens_per_second=90, ttft=0.1, running=0)
    wait_for("scale down to 1", lambda: replicas(kube, "interactive") == 1, timeout=15)
    tier = wait_for("status caught up", lambda: tier_at(kube, desired=1))
    assert tier["lastDirection"] == -1
    # The cool-down, on the operator's own clock: the test's polling (slower on a busy machine) would
    # see the scale-up late and the cool-down short.
    assert tier["lastScaleTime"] - last_up >= 3.0

    # Deleting the service removes everything it owns.
    kube._call("DELETE", f"{CRS}/chat")

    def owned() -> list[str]:
        return [
            f"{kind}/{obj['metadata']['name']}"
            for kind in ("Deployment", "Service", "ConfigMap", "Job")
            for obj in kube.list(kind, NS, {"dspark.ai/service": "chat"})
        ]

    try:
        wait_for("owned objects gone", lambda: not owned())
    except AssertionError:
        try:
            leftover = kube._call("GET", f"{CRS}/chat")["metadata"]
        except Exception as exc:
            leftover = repr(exc)[:200]
        raise AssertionError(
            f"still present after deleting the service: {owned()}; service: {leftover}"
        ) from None
    wait_for(
        "gauge removed",
        lambda: (
            REGISTRY.get_sample_value(
                "dspark_desired_replicas",
                {"dspark_namespace": NS, "dspark_service": "chat", "dspark_tier": "interactive"},
            )
            is None
        ),
    )


def test_invalid_spec_is_reported_not_crashed(cluster, operator_running):
    _, kube = cluster
    body = service()
    body["spec"]["tiers"][0]["minReplicas"] = 9  # above maxReplicas 4: the CRD's CEL rule, here pydantic's
    kube._call("POST", CRS, body=body)
    condition = wait_for(
        "SpecValid False",
        lambda: [
            c
            for c in status(kube).get("conditions", [])
            if c["type"] == "SpecValid" and c["status"] == "False"
        ],
    )
    assert "minReplicas" in condition[0]["message"]
    assert status(kube)["phase"] == "Invalid"
    assert kube.list("Job", NS) == []


def events(kube: Kube, reason: str) -> list[dict]:
    return [
        e for e in kube._call("GET", f"/api/v1/namespaces/{NS}/events")["items"] if e.get("reason") == reason
    ]


def condition(kube: Kube, type_: str) -> dict | None:
    return next((c for c in status(kube).get("conditions", []) if c["type"] == type_), None)


def test_a_failed_profile_is_tried_again_after_its_back_off(cluster, operator_running):
    emulated, kube = cluster
    profiling = {"timeoutSeconds": 600, "maxAttempts": 1, "backoffSeconds": 1, "failedRetrySeconds": 2}
    kube._call("POST", CRS, body=service(nodeTypes=["NVIDIA-H200"], profiling=profiling))
    first = wait_for("first profiling job", lambda: jobs_for(kube, "nvidia-h200"))[0]
    kube.patch("Job", NS, first["metadata"]["name"], {"status": {"failed": 1}})
    wait_for(
        "Failed", lambda: status(kube).get("profiles", {}).get("NVIDIA-H200", {}).get("state") == "Failed"
    )
    assert status(kube)["phase"] == "Degraded" and condition(kube, "ProfilesReady")["status"] == "False"
    assert wait_for("ProfilingFailed event", lambda: events(kube, "ProfilingFailed"))
    assert kube.get("Deployment", NS, "chat-interactive") is None

    # After failedRetrySeconds a new round starts, and its success deploys the tiers.
    second = wait_for(
        "a new round's job",
        lambda: [j for j in jobs_for(kube, "nvidia-h200") if j["metadata"]["name"].endswith("-2")],
    )[0]
    finish_profiling_job(emulated, kube, second, f"{PROFILE_BEGIN}\n{profile_json()}\n{PROFILE_END}\n")
    wait_for("interactive deployment", lambda: kube.get("Deployment", NS, "chat-interactive"))
    wait_for("phase Ready", lambda: status(kube).get("phase") == "Ready")
    profile = status(kube)["profiles"]["NVIDIA-H200"]
    assert profile["state"] == "Ready" and profile["attempts"] == 2 and profile["roundStart"] == 1


class FakePrometheus:
    """Prometheus' instant-query API on a fixed port, answering from a dialled tier; `stop()`
    takes it away (connections refused), `start()` brings it back on the same port."""

    def __init__(self) -> None:
        self.tokens_per_second, self.ttft, self.running = 50.0, 0.2, 2.0
        self.port = 0
        self.server: ThreadingHTTPServer | None = None

    def answer(self, query: str) -> list[dict]:
        if query.startswith("histogram_quantile(0.5,"):
            value = self.tokens_per_second
        elif query.startswith("histogram_quantile(0.95,"):
            value = self.ttft
        elif query.startswith("sum(vllm:num_requests_running"):
            value = self.running
        elif query.startswith("sum(vllm:num_requests_waiting"):
            value = 0.0
        else:
            return []  # no spec-decode counters: the operator's defaults apply
        return [{"metric": {}, "value": [time.time(), str(value)]}]

    def start(self) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                from urllib.parse import parse_qs, urlparse

                query = parse_qs(urlparse(self.path).query)["query"][0]
                body = {"status": "success", "data": {"resultType": "vector", "result": fake.answer(query)}}
                payload = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


@pytest.fixture()
def prometheus(monkeypatch) -> Iterator[FakePrometheus]:
    fake = FakePrometheus()
    fake.start()
    config = handlers.CONFIG.model_copy(update={"prometheus_url": f"http://127.0.0.1:{fake.port}"})
    monkeypatch.setattr(handlers, "CONFIG", config)  # read by the operator's start-up handler
    yield fake
    fake.stop()


def test_a_prometheus_outage_holds_replicas_with_a_condition_and_an_event(cluster, prometheus):
    emulated, kube = cluster
    with run_operator():
        kube._call("POST", CRS, body=service(nodeTypes=["NVIDIA-H200"]))
        job = wait_for("profiling job", lambda: jobs_for(kube, "nvidia-h200"))[0]
        finish_profiling_job(emulated, kube, job, f"{PROFILE_BEGIN}\n{profile_json()}\n{PROFILE_END}\n")
        wait_for("interactive deployment", lambda: kube.get("Deployment", NS, "chat-interactive"))

        # Below target: the tier scales up from Prometheus' numbers.
        prometheus.tokens_per_second, prometheus.running = 15.0, 4.0
        wait_for("scale up to 2", lambda: replicas(kube, "interactive") == 2)
        assert condition(kube, "MetricsAvailable")["status"] == "True"

        # Prometheus goes away: a condition and an event, and the replicas hold (the metrics it
        # last gave would scale the tier to 4 once the 1 s cool-down is over).
        prometheus.stop()
        down = wait_for(
            "MetricsAvailable False",
            lambda: c if (c := condition(kube, "MetricsAvailable")) and c["status"] == "False" else None,
        )
        assert "Prometheus" in down["message"] and "replicas held" in down["message"]
        assert wait_for("MetricsUnavailable event", lambda: events(kube, "MetricsUnavailable"))
        held = wait_for(
            "a held decision",
            lambda: "metrics unavailable" in (status(kube)["tiers"]["interactive"].get("lastDecision") or ""),
        )
        assert held
        evaluated = status(kube)["tiers"]["interactive"]["lastEvaluated"]
        time.sleep(2.0)
        assert replicas(kube, "interactive") == 2 and replicas(kube, "batch") == 1
        assert status(kube)["tiers"]["interactive"]["lastEvaluated"] > evaluated  # the passes go on
        assert len(events(kube, "MetricsUnavailable")) == 1  # one event per outage, not per pass

        # It comes back: the condition clears, an event says so, and scaling resumes.
        prometheus.start()
        wait_for("MetricsAvailable True", lambda: condition(kube, "MetricsAvailable")["status"] == "True")
        assert wait_for("MetricsAvailable event", lambda: events(kube, "MetricsAvailable"))
        wait_for("scale up to max 4", lambda: replicas(kube, "interactive") == 4)
