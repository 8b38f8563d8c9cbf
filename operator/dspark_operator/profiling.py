"""Per node type profiling: one Job per (service, node type, fingerprint), harvested into a ConfigMap.

Level-triggered and restart-safe: every pass derives the state from the objects in the cluster
(ConfigMap fingerprint, the Jobs' labels and status) plus the retry bookkeeping in the status.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

from dspark.sps_format import SpsProfile, extract_profile_from_log

from dspark_operator import builders
from dspark_operator.kube import Kube, KubeError
from dspark_operator.spec import ServiceSpec

LABEL_ATTEMPT = "dspark.ai/attempt"


@dataclass
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class ProfileOutcome:
    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.status.get("state") == "Ready"


def parse_time(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC).isoformat().replace("+00:00", "Z")


def observe_node_types(kube: Kube, node_label: str, allowed: tuple[str, ...]) -> list[str]:
    """Allowed node types that at least one node in the cluster carries, in the allowed order."""
    present = {
        (node.get("metadata", {}).get("labels") or {}).get(node_label) for node in kube.list("Node", None)
    }
    return [t for t in allowed if t in present]


def job_state(job: dict[str, Any], now: float, timeout: float) -> str:
    """Succeeded, Failed (including past its deadline) or Running."""
    status = job.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    if status.get("succeeded") or conditions.get("Complete") == "True":
        return "Succeeded"
    if status.get("failed") or conditions.get("Failed") == "True":
        return "Failed"
    started = parse_time(status.get("startTime")) or parse_time(job["metadata"].get("creationTimestamp"))
    if started is not None and now - started > timeout:
        return "Failed"
    return "Running"


def harvest_profile(kube: Kube, job: dict[str, Any]) -> SpsProfile:
    """The profile printed by the Job's succeeded pod."""
    meta = job["metadata"]
    pods = kube.list("Pod", meta["namespace"], {"job-name": meta["name"]})
    pods = [p for p in pods if (p.get("status") or {}).get("phase") == "Succeeded"] or pods
    if not pods:
        raise ValueError(f"no pod found for profiling job {meta['name']}")
    return extract_profile_from_log(kube.pod_log(meta["namespace"], pods[0]["metadata"]["name"], "profile"))


def _find_jobs(kube: Kube, namespace: str, service: str, node_type: str) -> list[dict[str, Any]]:
    labels = {
        builders.LABEL_SERVICE: service,
        builders.LABEL_COMPONENT: "profile",
        builders.LABEL_NODE_TYPE: builders.slug(node_type),
    }
    return [j for j in kube.list("Job", namespace, labels) if not j["metadata"].get("deletionTimestamp")]


def reconcile_profile(
    kube: Kube,
    body: dict[str, Any],
    spec: ServiceSpec,
    node_label: str,
    node_type: str,
    previous: dict[str, Any] | None,
    now: float,
    grace_seconds: float,
) -> ProfileOutcome:
    """Advance one node type's profile by one step and return its status entry."""
    previous = previous or {}
    namespace, service = body["metadata"]["namespace"], body["metadata"]["name"]
    fingerprint = builders.profile_fingerprint(spec, node_type)
    cm_name = builders.profile_configmap_name(service, node_type)
    same_fp = previous.get("fingerprint") == fingerprint
    attempts = int(previous.get("attempts") or 0) if same_fp else 0
    base = {"fingerprint": fingerprint, "configMap": cm_name, "attempts": attempts}

    jobs = _find_jobs(kube, namespace, service, node_type)
    for stale in [j for j in jobs if j["metadata"]["labels"].get(builders.LABEL_FINGERPRINT) != fingerprint]:
        kube.delete("Job", namespace, stale["metadata"]["name"])  # image or model changed
    jobs = [j for j in jobs if j["metadata"]["labels"].get(builders.LABEL_FINGERPRINT) == fingerprint]

    configmap = kube.get("ConfigMap", namespace, cm_name)
    if (
        configmap
        and (configmap["metadata"].get("labels") or {}).get(builders.LABEL_FINGERPRINT) == fingerprint
    ):
        for job in jobs:
            kube.delete("Job", namespace, job["metadata"]["name"])
        profile = SpsProfile.model_validate_json(configmap["data"][builders.PROFILE_KEY])
        return ProfileOutcome(_ready(base, profile))

    job = max(jobs, key=lambda j: int(j["metadata"]["labels"].get(LABEL_ATTEMPT, "0")), default=None)
    if job is not None:
        attempts = max(attempts, int(job["metadata"]["labels"].get(LABEL_ATTEMPT, "0")))
        base["attempts"] = attempts
        timeout = spec.profiling.timeout_seconds + grace_seconds
        state = job_state(job, now, timeout)
        job_name = job["metadata"]["name"]
        if state == "Running":
            return ProfileOutcome({**base, "state": "Running", "job": job_name, "message": None})
        failure = f"profiling job {job_name} failed"
        if state == "Succeeded":
            try:
                profile = harvest_profile(kube, job)
            except (ValueError, KubeError) as exc:
                failure = f"profiling job {job_name} succeeded but its profile is unusable: {exc}"
            else:
                kube.apply(builders.build_profile_configmap(body, node_type, fingerprint, profile.to_json()))
                kube.delete("Job", namespace, job_name)
                return ProfileOutcome(
                    _ready(base, profile),
                    [
                        Event(
                            "Normal",
                            "ProfileReady",
                            f"{node_type}: {len(profile.points)} points from {job_name}",
                        )
                    ],
                )
        kube.delete("Job", namespace, job_name)
        if attempts >= spec.profiling.max_attempts:
            message = f"{failure}; giving up after {attempts} attempts"
            return ProfileOutcome(
                {**base, "state": "Failed", "job": None, "nextRetryAt": None, "message": message},
                [Event("Warning", "ProfilingFailed", f"{node_type}: {message}")],
            )
        delay = spec.profiling.backoff_seconds * 2 ** (attempts - 1)
        message = f"{failure}; retry {attempts + 1}/{spec.profiling.max_attempts} in {delay:g}s"
        return ProfileOutcome(
            {**base, "state": "Retrying", "job": None, "nextRetryAt": iso(now + delay), "message": message},
            [Event("Warning", "ProfilingRetry", f"{node_type}: {message}")],
        )

    if same_fp and previous.get("state") == "Failed":
        return ProfileOutcome({**previous})  # terminal until the spec changes the fingerprint
    retry_at = parse_time(previous.get("nextRetryAt")) if same_fp else None
    if retry_at is not None and now < retry_at:
        return ProfileOutcome({**previous, **base, "state": "Retrying"})

    attempts += 1
    new_job = builders.build_profile_job(body, spec, node_label, node_type, fingerprint)
    new_job["metadata"]["name"] = f"{new_job['metadata']['name']}-{attempts}"
    for meta in (new_job["metadata"], new_job["spec"]["template"]["metadata"]):
        meta["labels"] = {**meta["labels"], LABEL_ATTEMPT: str(attempts)}
    try:
        kube.create(new_job)
    except KubeError as exc:
        if exc.status != 409:  # 409: a concurrent pass created it first
            raise
    return ProfileOutcome(
        {
            **base,
            "attempts": attempts,
            "state": "Running",
            "job": new_job["metadata"]["name"],
            "nextRetryAt": None,
            "message": None,
        },
        [
            Event(
                "Normal",
                "ProfilingStarted",
                f"{node_type}: job {new_job['metadata']['name']} (attempt {attempts})",
            )
        ],
    )


def _ready(base: dict, profile: SpsProfile) -> dict:
    """The node type's status once its profile is stored."""
    return {
        **base,
        "state": "Ready",
        "job": None,
        "nextRetryAt": None,
        "message": None,
        "summary": profile.summary(),
    }
