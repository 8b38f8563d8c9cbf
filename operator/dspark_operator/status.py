"""A DSparkService's status from what one reconcile pass found: pure, so every phase and condition
is testable without a cluster. The handlers apply it as a status patch."""

from __future__ import annotations

import datetime
from typing import Any

from dspark_operator.serving import WorkloadOutcome
from dspark_operator.spec import ServiceSpec

METRICS_CONDITION = "MetricsAvailable"


def condition(
    old: list[dict], type_: str, ok: bool, reason: str, message: str, now: float | None = None
) -> dict[str, Any]:
    """A status condition; its transition time moves only when its status changes."""
    status = "True" if ok else "False"
    previous = next((c for c in old if c.get("type") == type_), None)
    changed = previous is None or previous.get("status") != status
    at = (
        datetime.datetime.now(datetime.UTC)
        if now is None
        else datetime.datetime.fromtimestamp(now, datetime.UTC)
    )
    stamp = at.isoformat().replace("+00:00", "Z")
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": stamp if changed else previous.get("lastTransitionTime", stamp),
    }


def ready_profiles(profiles: dict[str, Any]) -> dict[str, str]:
    """Node type -> fingerprint of the profiles that are Ready."""
    return {t: p["fingerprint"] for t, p in profiles.items() if p and p.get("state") == "Ready"}


def service_status(
    spec: ServiceSpec,
    old: dict[str, Any],
    node_label: str,
    present: list[str],
    profiles: dict[str, Any],
    workloads: WorkloadOutcome,
    metrics: dict[str, Any] | None,
    generation: int | None,
    now: float,
) -> dict[str, Any]:
    """The status patch: profiles per node type, placements per tier, conditions and phase. `old` is
    the status the pass started from; `metrics` the MetricsAvailable condition the autoscaler set."""
    ready = ready_profiles(profiles)
    failed = [t for t, p in profiles.items() if p and p.get("state") == "Failed"]
    deployed = [t for t, p in workloads.tiers.items() if p["state"] == "Deployed"]
    all_deployed = len(deployed) == len(spec.tiers)
    old_conditions = list(old.get("conditions") or [])
    metrics = metrics or next((c for c in old_conditions if c.get("type") == METRICS_CONDITION), None)
    profiles_message = (
        f"ready on {sorted(ready)}" + (f"; failed on {failed}" if failed else "")
        if present
        else f"no node carries {node_label} in {list(spec.node_types)}"
    )
    conditions = [
        condition(old_conditions, "SpecValid", True, "Valid", "", now),
        condition(
            old_conditions,
            "ProfilesReady",
            bool(ready) and not failed,
            "Failed" if failed else ("Ready" if ready else "Profiling"),
            profiles_message,
            now,
        ),
        condition(
            old_conditions,
            "TiersDeployed",
            all_deployed,
            "Deployed" if all_deployed else "WaitingForProfile",
            f"{len(deployed)}/{len(spec.tiers)} tiers deployed",
            now,
        ),
    ]
    if workloads.kserve_missing:
        message = "KServe is not installed; using Deployments"
        conditions.append(condition(old_conditions, "KServeAvailable", False, "CRDMissing", message, now))
    if workloads.kuberay_missing:
        message = "runtime rayservice, but KubeRay's RayService CRD is not installed"
        conditions.append(condition(old_conditions, "KubeRayAvailable", False, "CRDMissing", message, now))
    if workloads.ray_service_ready is not None:
        ok, message = workloads.ray_service_ready
        reason = "Ready" if ok else "NotReady"
        conditions.append(condition(old_conditions, "RayServiceReady", ok, reason, message, now))
    if metrics is not None:
        conditions.append(metrics)
    degraded = failed or workloads.kuberay_missing
    return {
        "phase": "Ready" if all_deployed and not degraded else "Degraded" if degraded else "Profiling",
        "profiles": profiles,
        "profilesReady": f"{len(ready)}/{len(present)}",
        "tiers": _tiers_patch(old.get("tiers") or {}, workloads.tiers, now),
        "conditions": conditions,
        "observedGeneration": generation,
    }


def _tiers_patch(old: dict[str, Any], placements: dict[str, dict[str, Any]], now: float) -> dict[str, Any]:
    """Each placed tier's status (a newly created one stamped as scaled now); None removes a gone tier."""
    patch: dict[str, Any] = {}
    for name, placement in placements.items():
        status = {k: v for k, v in placement.items() if k != "created"}
        patch[name] = {**status, **({"lastScaleTime": now} if placement.get("created") else {})}
    return patch | {name: None for name in old if name not in placements}
