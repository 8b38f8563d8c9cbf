"""Per tier serving workloads: placement on a profiled node type, Deployment+Service or KServe."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dspark_operator import builders, ray_builders
from dspark_operator.kube import Kube
from dspark_operator.profiling import Event
from dspark_operator.spec import ServiceSpec, TierSpec

KSERVE_CRD = "inferenceservices.serving.kserve.io"


@dataclass
class WorkloadOutcome:
    tiers: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    kserve_missing: bool = False
    kuberay_missing: bool = False
    # The RayService's readiness as KubeRay reports it: (ready, message); None in the Deployment mode.
    ray_service_ready: tuple[bool, str] | None = None


def place_tier(spec: ServiceSpec, tier: TierSpec, ready: dict[str, str]) -> str | None:
    """The most preferred node type of the tier that has a ready profile (ready: type -> fingerprint)."""
    return next((t for t in spec.tier_node_types(tier) if t in ready), None)


def workload_replicas(kube: Kube, kind: str, namespace: str, name: str, tier: str) -> int | None:
    """The tier's replicas as its workload holds them; None when there is no workload yet."""
    obj = kube.get(kind, namespace, name)
    if obj is None:
        return None
    if kind == ray_builders.KIND:
        return ray_builders.tier_replicas(obj).get(tier)
    if kind == "InferenceService":
        return int(obj["spec"]["predictor"].get("minReplicas", 0))
    return int(obj["spec"].get("replicas", 1))


def set_workload_replicas(kube: Kube, kind: str, namespace: str, name: str, tier: str, replicas: int) -> None:
    if kind == ray_builders.KIND:
        obj = kube.get(kind, namespace, name)
        if obj is None:
            return  # removed since the replicas were read: the next reconcile builds it again
        patch = ray_builders.scale_patch(obj, tier, replicas)
    elif kind == "InferenceService":
        patch = {"spec": {"predictor": {"minReplicas": replicas, "maxReplicas": max(replicas, 1)}}}
    else:
        patch = {"spec": {"replicas": replicas}}
    kube.patch(kind, namespace, name, patch)


def reconcile_workloads(
    kube: Kube,
    body: dict[str, Any],
    spec: ServiceSpec,
    node_label: str,
    ready: dict[str, str],
    tier_status: dict[str, Any],
) -> WorkloadOutcome:
    """Create or update each tier's workload; remove workloads of tiers no longer in the spec."""
    namespace, service = body["metadata"]["namespace"], body["metadata"]["name"]
    outcome = WorkloadOutcome()
    kind = "Deployment"
    if spec.serving.kind == "InferenceService":
        if kube.crd_exists(KSERVE_CRD):
            kind = "InferenceService"
        else:
            outcome.kserve_missing = True

    for tier in spec.tiers:
        name = builders.workload_name(service, tier.name)
        node_type = place_tier(spec, tier, ready)
        if node_type is None:
            outcome.tiers[tier.name] = {"state": "WaitingForProfile", "nodeType": None}
            continue
        fingerprint = ready[node_type]
        # A restarted operator keeps the autoscaler's last decision instead of resetting to the minimum.
        previous = tier_status.get(tier.name) or {}
        replicas = int(previous.get("desiredReplicas") or tier.min_replicas)
        if kind == "InferenceService":
            obj = builders.build_inference_service(
                body, spec, tier, node_label, node_type, fingerprint, replicas
            )
        else:
            obj = builders.build_serving_deployment(
                body, spec, tier, node_label, node_type, fingerprint, replicas
            )
            kube.apply(builders.build_serving_service(body, spec, tier))
        if previous.get("kind") not in (None, kind):  # the serving kind was switched
            kube.delete(previous["kind"], namespace, name)
            if previous["kind"] == "Deployment":
                kube.delete("Service", namespace, name)
        _, created = kube.apply(obj, keep_replicas=True)
        if created:
            outcome.events.append(
                Event("Normal", "WorkloadCreated", f"tier {tier.name}: {kind} {name} on {node_type}")
            )
        outcome.tiers[tier.name] = {
            "state": "Deployed",
            "nodeType": node_type,
            "kind": kind,
            "workload": name,
            "profileFingerprint": fingerprint,
            "created": created,
        }

    if any((status or {}).get("kind") == ray_builders.KIND for status in tier_status.values()):
        kube.delete(ray_builders.KIND, namespace, ray_builders.rayservice_name(service))  # runtime switched
    wanted = {t.name for t in spec.tiers}
    for stale_kind in ("Deployment", "Service"):
        for obj in kube.list(
            stale_kind, namespace, {builders.LABEL_SERVICE: service, builders.LABEL_COMPONENT: "serving"}
        ):
            if obj["metadata"]["labels"].get(builders.LABEL_TIER) not in wanted:
                kube.delete(stale_kind, namespace, obj["metadata"]["name"])
    return outcome
