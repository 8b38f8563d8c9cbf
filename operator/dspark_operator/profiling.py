"""Per node type profiling: one Job per (service, node type, fingerprint), harvested into a ConfigMap.

Level-triggered and restart-safe: every pass derives the state from the objects in the cluster
(ConfigMap fingerprint, the Jobs' labels and status) plus the retry bookkeeping in the status.
A pass reads the cluster (`observe_profile`), decides in a pure function (`next_profile_step`,
which returns the new status entry and a list of actions) and carries the actions out
(`run_profile_actions`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from dspark.sps_format import SpsProfile, extract_profile_from_log

from dspark_operator import builders
from dspark_operator.kube import Kube, KubeError
from dspark_operator.spec import ProfilingSpec, ServiceSpec

LABEL_ATTEMPT = "dspark.ai/attempt"


@dataclass
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class ProfileJob:
    """A profiling Job of the current fingerprint, as a pass sees it."""

    name: str
    attempt: int
    state: str  # Running | Succeeded | Failed (`job_state`)


@dataclass(frozen=True)
class ProfileObservation:
    """What one pass reads from the cluster for one node type."""

    node_type: str
    fingerprint: str
    config_map: str
    job_prefix: str  # a new Job is named `<job_prefix>-<attempt>`
    stored: SpsProfile | None  # the ConfigMap's profile, when it carries the current fingerprint
    jobs: tuple[ProfileJob, ...]  # Jobs of the current fingerprint
    stale_jobs: tuple[str, ...]  # Jobs of another fingerprint (the image or model changed)
    harvest: SpsProfile | str | None  # the newest Job's profile once it succeeded, or why it is unusable


@dataclass(frozen=True)
class DeleteJob:
    name: str


@dataclass(frozen=True)
class StoreProfile:
    profile: SpsProfile


@dataclass(frozen=True)
class CreateJob:
    name: str
    attempt: int


ProfileAction = DeleteJob | StoreProfile | CreateJob


@dataclass(frozen=True)
class ProfileStep:
    """The node type's new status entry, what to do in the cluster, and the events to post."""

    status: dict[str, Any]
    actions: tuple[ProfileAction, ...] = ()
    events: tuple[Event, ...] = ()

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


def observe_profile(
    kube: Kube,
    body: dict[str, Any],
    spec: ServiceSpec,
    node_label: str,
    node_type: str,
    now: float,
    grace_seconds: float,
) -> ProfileObservation:
    """Read one node type's profile ConfigMap and Jobs (and the newest Job's log once it succeeded)."""
    namespace, service = body["metadata"]["namespace"], body["metadata"]["name"]
    fingerprint = builders.profile_fingerprint(spec, node_type)
    config_map = builders.profile_configmap_name(service, node_type)
    labels = {
        builders.LABEL_SERVICE: service,
        builders.LABEL_COMPONENT: "profile",
        builders.LABEL_NODE_TYPE: builders.slug(node_type),
    }
    found = [j for j in kube.list("Job", namespace, labels) if not j["metadata"].get("deletionTimestamp")]
    current = [j for j in found if j["metadata"]["labels"].get(builders.LABEL_FINGERPRINT) == fingerprint]
    stale = tuple(j["metadata"]["name"] for j in found if j not in current)

    stored = None
    configmap = kube.get("ConfigMap", namespace, config_map)
    if (
        configmap
        and (configmap["metadata"].get("labels") or {}).get(builders.LABEL_FINGERPRINT) == fingerprint
    ):
        stored = SpsProfile.model_validate_json(configmap["data"][builders.PROFILE_KEY])

    timeout = spec.profiling.timeout_seconds + grace_seconds
    jobs = tuple(
        ProfileJob(
            j["metadata"]["name"],
            int(j["metadata"]["labels"].get(LABEL_ATTEMPT, "0")),
            job_state(j, now, timeout),
        )
        for j in current
    )
    harvest: SpsProfile | str | None = None
    newest = _newest(jobs)
    if stored is None and newest is not None and newest.state == "Succeeded":
        try:
            harvest = harvest_profile(kube, next(j for j in current if j["metadata"]["name"] == newest.name))
        except (ValueError, KubeError) as exc:
            harvest = str(exc)
    job_prefix = builders.profile_job_name(service, node_type, fingerprint)
    return ProfileObservation(node_type, fingerprint, config_map, job_prefix, stored, jobs, stale, harvest)


def _newest(jobs: tuple[ProfileJob, ...]) -> ProfileJob | None:
    return max(jobs, key=lambda j: j.attempt, default=None)


def next_profile_step(
    seen: ProfileObservation, previous: dict[str, Any] | None, settings: ProfilingSpec, now: float
) -> ProfileStep:
    """One node type's next profiling step: stored -> Ready; a Job running -> Running; a Job
    succeeded -> store its profile; a Job failed -> retry with exponential backoff until
    `max_attempts` in a row failed, then Failed, and a new round of attempts after
    `failed_retry_seconds`; no Job -> start one.

    `attempts` counts every Job of the fingerprint (it names them); `roundStart` is the count
    before the current round began."""
    previous = previous or {}
    node_type = seen.node_type
    same_fp = previous.get("fingerprint") == seen.fingerprint
    attempts = int(previous.get("attempts") or 0) if same_fp else 0
    round_start = int(previous.get("roundStart") or 0) if same_fp else 0
    base = {
        "fingerprint": seen.fingerprint,
        "configMap": seen.config_map,
        "attempts": attempts,
        "roundStart": round_start,
    }
    cleanup = tuple(DeleteJob(name) for name in seen.stale_jobs)

    if seen.stored is not None:
        done = tuple(DeleteJob(j.name) for j in seen.jobs)
        return ProfileStep(_ready(base, seen.stored), cleanup + done)

    job = _newest(seen.jobs)
    if job is not None:
        attempts = max(attempts, job.attempt)
        base["attempts"] = attempts
        if job.state == "Running":
            return ProfileStep({**base, "state": "Running", "job": job.name, "message": None}, cleanup)
        failure = f"profiling job {job.name} failed"
        if job.state == "Succeeded":
            if isinstance(seen.harvest, SpsProfile):
                return ProfileStep(
                    _ready(base, seen.harvest),
                    (*cleanup, StoreProfile(seen.harvest), DeleteJob(job.name)),
                    (
                        Event(
                            "Normal",
                            "ProfileReady",
                            f"{node_type}: {len(seen.harvest.points)} points from {job.name}",
                        ),
                    ),
                )
            failure = f"profiling job {job.name} succeeded but its profile is unusable: {seen.harvest}"
        actions = (*cleanup, DeleteJob(job.name))
        in_round = attempts - round_start
        if in_round >= settings.max_attempts:
            delay = settings.failed_retry_seconds
            message = f"{failure}; {in_round} attempts in a row failed, a new round in {delay:g}s"
            return ProfileStep(
                {**base, "state": "Failed", "job": None, "nextRetryAt": iso(now + delay), "message": message},
                actions,
                (Event("Warning", "ProfilingFailed", f"{node_type}: {message}"),),
            )
        delay = settings.backoff_seconds * 2 ** (in_round - 1)
        message = f"{failure}; retry {in_round + 1}/{settings.max_attempts} in {delay:g}s"
        return ProfileStep(
            {**base, "state": "Retrying", "job": None, "nextRetryAt": iso(now + delay), "message": message},
            actions,
            (Event("Warning", "ProfilingRetry", f"{node_type}: {message}"),),
        )

    retry_at = parse_time(previous.get("nextRetryAt")) if same_fp else None
    failed = same_fp and previous.get("state") == "Failed"
    if failed and retry_at is None:  # recorded without a retry time: the back-off starts now
        return ProfileStep({**previous, "nextRetryAt": iso(now + settings.failed_retry_seconds)}, cleanup)
    if retry_at is not None and now < retry_at:
        return ProfileStep({**previous, **base, "state": "Failed" if failed else "Retrying"}, cleanup)

    started = f"job {{name}} (attempt {attempts + 1})"
    if failed:  # the back-off after a failed round is over: a new round of attempts
        round_start = attempts
        started += f", after {attempts} failed"
    attempts += 1
    name = f"{seen.job_prefix}-{attempts}"
    return ProfileStep(
        {
            **base,
            "attempts": attempts,
            "roundStart": round_start,
            "state": "Running",
            "job": name,
            "nextRetryAt": None,
            "message": None,
        },
        (*cleanup, CreateJob(name, attempts)),
        (Event("Normal", "ProfilingStarted", f"{node_type}: {started.format(name=name)}"),),
    )


def run_profile_actions(
    kube: Kube,
    body: dict[str, Any],
    spec: ServiceSpec,
    node_label: str,
    seen: ProfileObservation,
    actions: tuple[ProfileAction, ...],
) -> None:
    """Carry out a step's actions in order."""
    namespace = body["metadata"]["namespace"]
    for action in actions:
        if isinstance(action, DeleteJob):
            kube.delete("Job", namespace, action.name)
        elif isinstance(action, StoreProfile):
            kube.apply(
                builders.build_profile_configmap(
                    body, seen.node_type, seen.fingerprint, action.profile.to_json()
                )
            )
        else:
            job = builders.build_profile_job(body, spec, node_label, seen.node_type, seen.fingerprint)
            job["metadata"]["name"] = action.name
            for meta in (job["metadata"], job["spec"]["template"]["metadata"]):
                meta["labels"] = {**meta["labels"], LABEL_ATTEMPT: str(action.attempt)}
            try:
                kube.create(job)
            except KubeError as exc:
                if exc.status != 409:  # 409: a concurrent pass created it first
                    raise


def reconcile_profile(
    kube: Kube,
    body: dict[str, Any],
    spec: ServiceSpec,
    node_label: str,
    node_type: str,
    previous: dict[str, Any] | None,
    now: float,
    grace_seconds: float,
) -> ProfileStep:
    """Advance one node type's profile by one step and return it (status entry, events)."""
    seen = observe_profile(kube, body, spec, node_label, node_type, now, grace_seconds)
    step = next_profile_step(seen, previous, spec.profiling, now)
    run_profile_actions(kube, body, spec, node_label, seen, step.actions)
    return step


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
