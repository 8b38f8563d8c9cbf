"""`runtime: rayservice` end to end: the real kopf operator against kmock, with KubeRay's CRD.

As in test_operator_kmock.py, the test plays the cluster's other controllers: the Job controller
(profiling pods with their logs) and now KubeRay (the RayService's status, and the Serve Service
in front of the applications, whose /metrics the test dials). One emulated cluster and one
operator serve the whole module.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from cluster_emulator import EmulatedCluster
from crd_schemas import kuberay_validator
from dspark.sps_format import PROFILE_BEGIN, PROFILE_END
from dspark_operator.kube import Kube
from operator_fixtures import profile_json, service
from test_operator_kmock import (
    FakeServingMetrics,
    connect_kube,
    finish_profiling_job,
    metrics_server,
    run_operator,
    wait_for,
)

NS = "default"
CRS = "/apis/dspark.ai/v1alpha1/namespaces/default/dsparkservices"
RAYSERVICES = "/apis/ray.io/v1/namespaces/default/rayservices"
LOG = f"{PROFILE_BEGIN}\n{profile_json()}\n{PROFILE_END}\n"


@dataclass
class Applications:
    """The Serve applications' /metrics behind KubeRay's Serve Service: one dialled fake, and the
    paths the operator scraped."""

    fake: FakeServingMetrics
    port: int
    paths: set[str]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[EmulatedCluster, Kube, Applications]]:
    """kmock (serving KubeRay's RayServices) with three GPU node types, the operator running against it."""
    fake, paths = FakeServingMetrics(), set()
    with (
        metrics_server(fake, paths) as port,
        EmulatedCluster() as emulated,
        pytest.MonkeyPatch.context() as env,
    ):
        kube = connect_kube(emulated, tmp_path_factory.mktemp("kube") / "kubeconfig.yaml", env)
        with run_operator():
            yield emulated, kube, Applications(fake, port, paths)


def status(kube: Kube, name: str) -> dict[str, Any]:
    return kube._call("GET", f"{CRS}/{name}").get("status") or {}


def rayservice(kube: Kube, name: str) -> dict[str, Any] | None:
    return kube.get("RayService", NS, name)


def applications(obj: dict[str, Any]) -> dict[str, int]:
    """Engine replicas per application in serveConfigV2."""
    config = yaml.safe_load(obj["spec"]["serveConfigV2"])
    return {a["name"]: a["deployments"][0]["num_replicas"] for a in config["applications"]}


def workers(obj: dict[str, Any]) -> dict[str, int]:
    """Worker pods per node type."""
    return {
        g["template"]["metadata"]["annotations"]["dspark.ai/node-type"]: g["replicas"]
        for g in obj["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    }


def profiling_job(kube: Kube, service_name: str, gpu_slug: str) -> dict | None:
    return next(
        (
            j
            for j in kube.list("Job", NS, {"dspark.ai/service": service_name})
            if gpu_slug in j["metadata"]["name"]
        ),
        None,
    )


def condition(kube: Kube, name: str, type_: str) -> dict | None:
    return next((c for c in status(kube, name).get("conditions", []) if c["type"] == type_), None)


def events(kube: Kube, reason: str) -> list[dict]:
    items = kube._call("GET", f"/api/v1/namespaces/{NS}/events")["items"]
    return [e for e in items if e.get("reason") == reason]


def test_a_rayservice_is_profiled_deployed_reported_scaled_and_removed(cluster):
    emulated, kube, apps = cluster
    body = service(runtime="rayservice")
    body["spec"]["tiers"][1]["nodeTypes"] = ["NVIDIA-L40S"]  # batch runs on the L40S only
    kube._call("POST", CRS, body=body)

    # A profiling Job per present node type, as in the Deployment mode. H200's profile comes first:
    # the RayService appears with its worker group and the interactive tier's application.
    h200 = wait_for("H200 profiling job", lambda: profiling_job(kube, "chat", "nvidia-h200"))
    l40s = wait_for("L40S profiling job", lambda: profiling_job(kube, "chat", "nvidia-l40s"))
    assert profiling_job(kube, "chat", "tesla-t4") is None
    finish_profiling_job(emulated, kube, h200, LOG)
    first = wait_for("RayService", lambda: rayservice(kube, "chat"))
    kuberay_validator().validate(first)
    assert applications(first) == {"interactive": 1} and workers(first) == {"NVIDIA-H200": 1}
    assert first["metadata"]["ownerReferences"][0]["kind"] == "DSparkService"
    tiers = wait_for(
        "tier placements",
        lambda: status(kube, "chat").get("tiers", {}).get("batch") and status(kube, "chat")["tiers"],
    )
    assert tiers["interactive"]["state"] == "Deployed" and tiers["interactive"]["kind"] == "RayService"
    assert tiers["batch"]["state"] == "WaitingForProfile"
    assert kube.list("Deployment", NS, {"dspark.ai/service": "chat"}) == []

    # L40S's profile adds its worker group and the batch tier's application.
    finish_profiling_job(emulated, kube, l40s, LOG)
    both = wait_for(
        "batch application", lambda: (o := rayservice(kube, "chat")) and "batch" in applications(o) and o
    )
    kuberay_validator().validate(both)
    assert applications(both) == {"interactive": 1, "batch": 1}
    assert workers(both) == {"NVIDIA-H200": 1, "NVIDIA-L40S": 1}
    pods = {
        g["groupName"]: g["template"]["spec"] for g in both["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    }
    assert {p["nodeSelector"]["nvidia.com/gpu.product"] for p in pods.values()} == {
        "NVIDIA-H200",
        "NVIDIA-L40S",
    }

    # KubeRay reports the service ready with its applications running: so does the DSparkService.
    app_status = {"interactive": {"status": "RUNNING"}, "batch": {"status": "RUNNING"}}
    kube._call(
        "PATCH",
        f"{RAYSERVICES}/chat/status",
        body={
            "status": {
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "NonZeroServeEndpoints",
                        "message": "",
                        "lastTransitionTime": "2026-01-01T00:00:00Z",
                    }
                ],
                "activeServiceStatus": {"applicationStatuses": app_status},
            }
        },
        content_type="application/merge-patch+json",
    )
    wait_for(
        "RayServiceReady", lambda: (c := condition(kube, "chat", "RayServiceReady")) and c["status"] == "True"
    )
    wait_for("phase Ready", lambda: status(kube, "chat").get("phase") == "Ready")
    assert status(kube, "chat")["tiers"]["interactive"]["applicationStatus"] == "RUNNING"

    # KubeRay's Serve Service in front of the applications; their metrics below target scale the
    # tiers up in serveConfigV2, and the worker groups follow.
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "chat-serve-svc", "namespace": NS},
            "spec": {"clusterIP": "127.0.0.1", "ports": [{"name": "serve", "port": apps.port}]},
        }
    )
    apps.fake.dial(tokens_per_second=15, ttft=0.3, running=4)
    wait_for("interactive at 2", lambda: applications(rayservice(kube, "chat"))["interactive"] == 2)
    scaled = wait_for(
        "interactive at max 4",
        lambda: (o := rayservice(kube, "chat")) and applications(o)["interactive"] == 4 and o,
    )
    wait_for("H200 workers at 4", lambda: workers(rayservice(kube, "chat"))["NVIDIA-H200"] == 4)
    assert {"/interactive/metrics", "/batch/metrics"} <= apps.paths
    kuberay_validator().validate(scaled)
    tier = wait_for(
        "status of the scale-up",
        lambda: (t := status(kube, "chat")["tiers"]["interactive"]).get("desiredReplicas") == 4 and t,
    )
    assert "per-user p50" in tier["lastDecision"]
    assert wait_for("ScaledUp events", lambda: len(events(kube, "ScaledUp")) >= 2)

    # Above target and idle: both tiers back to their minimum after the cool-down.
    apps.fake.dial(tokens_per_second=90, ttft=0.1, running=0)
    wait_for(
        "interactive at 1",
        lambda: applications(rayservice(kube, "chat")) == {"interactive": 1, "batch": 1},
        timeout=15,
    )
    assert wait_for(
        "workers refitted", lambda: workers(rayservice(kube, "chat")) == {"NVIDIA-H200": 1, "NVIDIA-L40S": 1}
    )

    # Deleting the service removes the RayService with everything else it owns.
    kube._call("DELETE", f"{CRS}/chat")
    wait_for("RayService gone", lambda: rayservice(kube, "chat") is None)


def test_switching_the_runtime_replaces_the_tiers_workloads(cluster):
    emulated, kube, _ = cluster
    body = service(nodeTypes=["NVIDIA-H200"])
    body["metadata"]["name"] = "switch"
    kube._call("POST", CRS, body=body)
    job = wait_for("profiling job", lambda: profiling_job(kube, "switch", "nvidia-h200"))
    finish_profiling_job(emulated, kube, job, LOG)
    wait_for("Deployment mode", lambda: kube.get("Deployment", NS, "switch-interactive"))
    assert rayservice(kube, "switch") is None

    patch = {"spec": {"runtime": "rayservice"}}
    kube._call("PATCH", f"{CRS}/switch", body=patch, content_type="application/merge-patch+json")
    obj = wait_for("RayService", lambda: rayservice(kube, "switch"))
    assert applications(obj) == {"interactive": 1, "batch": 1}
    wait_for(
        "Deployments removed", lambda: kube.list("Deployment", NS, {"dspark.ai/service": "switch"}) == []
    )
    assert kube.get("Service", NS, "switch-interactive") is None

    patch = {"spec": {"runtime": "deployment"}}
    kube._call("PATCH", f"{CRS}/switch", body=patch, content_type="application/merge-patch+json")
    wait_for("Deployment back", lambda: kube.get("Deployment", NS, "switch-interactive"))
    wait_for("RayService removed", lambda: rayservice(kube, "switch") is None)
    kube._call("DELETE", f"{CRS}/switch")
    wait_for("owned objects gone", lambda: kube.list("Deployment", NS, {"dspark.ai/service": "switch"}) == [])
