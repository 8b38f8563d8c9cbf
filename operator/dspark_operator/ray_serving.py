"""`runtime: rayservice`: the service's one RayService, created or updated from the ready profiles."""

from __future__ import annotations

from typing import Any

from dspark_operator import builders, ray_builders
from dspark_operator.kube import Kube
from dspark_operator.profiling import Event
from dspark_operator.serving import WorkloadOutcome, place_tier
from dspark_operator.spec import ServiceSpec


def reconcile_rayservice(
    kube: Kube,
    body: dict[str, Any],
    spec: ServiceSpec,
    node_label: str,
    ready: dict[str, str],
    tier_status: dict[str, Any],
) -> WorkloadOutcome:
    """Apply the RayService: an application per tier with a ready profile, keeping the replica
    counts it already holds (the autoscaler owns them); remove the Deployment mode's workloads."""
    namespace, service = body["metadata"]["namespace"], body["metadata"]["name"]
    name = ray_builders.rayservice_name(service)
    outcome = WorkloadOutcome()
    if not kube.serves(ray_builders.API_VERSION, "rayservices"):
        # Whatever serves now keeps serving until KubeRay is there to take over.
        outcome.kuberay_missing = True
        outcome.tiers = {t.name: {"state": "WaitingForKubeRay", "nodeType": None} for t in spec.tiers}
        return outcome
    _remove_deployment_mode(kube, namespace, service, tier_status)

    placements: dict[str, str] = {}
    for tier in spec.tiers:
        if node_type := place_tier(spec, tier, ready):
            placements[tier.name] = node_type
        else:
            outcome.tiers[tier.name] = {"state": "WaitingForProfile", "nodeType": None}
    if not placements:
        return outcome  # an application needs a profiled worker group to run on

    existing = kube.get(ray_builders.KIND, namespace, name)
    held = ray_builders.tier_replicas(existing) if existing else {}
    replicas = {
        tier.name: held.get(tier.name)
        # A restarted operator keeps the autoscaler's last decision instead of resetting to the minimum.
        or int((tier_status.get(tier.name) or {}).get("desiredReplicas") or tier.min_replicas)
        for tier in spec.tiers
        if tier.name in placements
    }
    obj = ray_builders.build_rayservice(body, spec, node_label, ready, placements, replicas)
    _, created = kube.apply(obj)
    if created:
        outcome.events.append(
            Event("Normal", "WorkloadCreated", f"RayService {name}: tiers {sorted(placements)}")
        )
    applications = ((existing or {}).get("status") or {}).get("activeServiceStatus", {}).get(
        "applicationStatuses"
    ) or {}
    for tier_name, node_type in placements.items():
        app = applications.get(tier_name) or {}
        outcome.tiers[tier_name] = {
            "state": "Deployed",
            "nodeType": node_type,
            "kind": ray_builders.KIND,
            "workload": name,
            "profileFingerprint": ready[node_type],
            "applicationStatus": app.get("status"),
            "created": tier_name not in held,
        }
    outcome.ray_service_ready = _readiness(existing)
    return outcome


def _readiness(rayservice: dict[str, Any] | None) -> tuple[bool, str]:
    """KubeRay's Ready condition of the RayService (or, from older KubeRay, its serviceStatus)."""
    status = (rayservice or {}).get("status") or {}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is not None:
        return ready.get("status") == "True", ready.get("message") or ready.get("reason") or ""
    if status.get("serviceStatus"):
        return status["serviceStatus"] == "Running", f"serviceStatus {status['serviceStatus']}"
    return False, "KubeRay has not reported on it yet"


def _remove_deployment_mode(kube: Kube, namespace: str, service: str, tier_status: dict[str, Any]) -> None:
    """The per-tier Deployments, Services and InferenceServices left from `runtime: deployment`."""
    labels = {builders.LABEL_SERVICE: service, builders.LABEL_COMPONENT: "serving"}
    for kind in ("Deployment", "Service"):
        for obj in kube.list(kind, namespace, labels):
            kube.delete(kind, namespace, obj["metadata"]["name"])
    for tier, status in tier_status.items():
        if (status or {}).get("kind") == "InferenceService":
            kube.delete("InferenceService", namespace, builders.workload_name(service, tier))
