"""kopf handlers: reconcile profiles and workloads, autoscale tiers. Run with `python -m dspark_operator`."""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections import defaultdict
from typing import Any

import kopf
import pydantic
from prometheus_client import start_http_server

from dspark_operator.autoscaler import autoscale_service, forget_service, metrics_source
from dspark_operator.config import OperatorConfig
from dspark_operator.kube import Kube, connection_settings, load_client_configuration
from dspark_operator.profiling import Event, observe_node_types, reconcile_profile
from dspark_operator.ray_serving import reconcile_rayservice
from dspark_operator.serving import reconcile_workloads
from dspark_operator.spec import GROUP, PLURAL, VERSION, ServiceSpec
from dspark_operator.status import METRICS_CONDITION, condition, ready_profiles, service_status

CONFIG = OperatorConfig.from_env()
RESOURCE = (GROUP, VERSION, PLURAL)


class _State:
    """Process-wide clients, created at start-up (after the kubeconfig is loaded)."""

    kube: Kube
    source: Any
    profile_cache: dict = {}  # noqa: RUF012  (one per process, on purpose)


@kopf.on.startup()
def start(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
    # Progress and diff-base in annotations: the status belongs to this operator's own fields.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kopf.dspark.ai")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="kopf.dspark.ai")
    settings.scanning.disabled = True  # the CRD is installed before the operator: no CRD/namespace watching
    settings.posting.level = logging.WARNING
    # Timers hold kopf's finalizer; a deletion that lands mid-pass is re-checked this soon, not in 60 s.
    settings.background.cancellation_polling = 2
    load_client_configuration()
    _State.kube = Kube.from_default_configuration()
    _State.source = metrics_source(CONFIG)
    if CONFIG.metrics_port:
        start_http_server(CONFIG.metrics_port)
    logger.info("dspark operator started: %s", CONFIG.model_dump())


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf connects exactly as the Kubernetes client does (in-cluster, else KUBECONFIG)."""
    load_client_configuration()
    return kopf.ConnectionInfo(**connection_settings())


def _post(body: dict[str, Any], events: list) -> None:
    # kopf.event, not kopf.info: settings.posting.level keeps kopf's own log lines out of the
    # events, and would drop the operator's Normal events (ScaledUp, ProfileReady, ...) with them.
    for event in events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)


def _parse_spec(body: dict[str, Any], patch: kopf.Patch) -> ServiceSpec | None:
    try:
        return ServiceSpec.model_validate(dict(body["spec"]))
    except pydantic.ValidationError as exc:
        message = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        old = list((body.get("status") or {}).get("conditions") or [])
        patch.status["phase"] = "Invalid"
        patch.status["conditions"] = [condition(old, "SpecValid", False, "InvalidSpec", message)]
        return None


_RECONCILE_LOCKS: dict[str, threading.Lock] = defaultdict(threading.Lock)
# The MetricsAvailable condition the autoscaler last set, per service uid: both timers write the
# status' conditions list, and a reconcile pass must not put back an older one from its snapshot.
_METRICS_CONDITIONS: dict[str, dict[str, Any]] = {}


def reconcile(body: dict[str, Any], patch: kopf.Patch, logger: logging.Logger) -> None:
    """Level-triggered: profiles for present node types, then workloads for tiers with a ready profile.

    The change handlers and the timer may fire together; one pass per service at a time keeps
    a pass from acting on what another pass is halfway through changing.
    """
    with _RECONCILE_LOCKS[body["metadata"]["uid"]]:
        _reconcile(body, patch, logger)


def _reconcile(body: dict[str, Any], patch: kopf.Patch, logger: logging.Logger) -> None:
    spec = _parse_spec(body, patch)
    if spec is None:
        kopf.warn(body, reason="InvalidSpec", message=patch.status["conditions"][0]["message"])
        return
    kube, now = _State.kube, time.time()
    status = body.get("status") or {}
    node_label = spec.node_type_label or CONFIG.node_label
    present = observe_node_types(kube, node_label, spec.node_types)
    profiles, events = _reconcile_profiles(body, spec, node_label, present, status.get("profiles") or {}, now)
    reconcile_serving = reconcile_rayservice if spec.runtime == "rayservice" else reconcile_workloads
    workloads = reconcile_serving(
        kube, body, spec, node_label, ready_profiles(profiles), status.get("tiers") or {}
    )
    _post(body, events + workloads.events)
    if workloads.kserve_missing:
        kopf.warn(
            body,
            reason="KServeMissing",
            message="serving.kind InferenceService but KServe's CRD is absent; serving with Deployments",
        )
    if workloads.kuberay_missing:
        kopf.warn(
            body, reason="KubeRayMissing", message="runtime rayservice but KubeRay's RayService CRD is absent"
        )
    metrics = _METRICS_CONDITIONS.get(body["metadata"]["uid"])
    generation = body["metadata"].get("generation")
    patch.status.update(
        service_status(spec, status, node_label, present, profiles, workloads, metrics, generation, now)
    )


def _reconcile_profiles(
    body: dict[str, Any],
    spec: ServiceSpec,
    node_label: str,
    present: list[str],
    old: dict[str, Any],
    now: float,
) -> tuple[dict[str, Any], list[Event]]:
    """Each present node type's profile status (None removes a gone type's), and the events on the way."""
    profiles: dict[str, Any] = {t: None for t in old if t not in present}
    events: list[Event] = []
    for node_type in present:
        outcome = reconcile_profile(
            _State.kube,
            body,
            spec,
            node_label,
            node_type,
            old.get(node_type),
            now,
            CONFIG.profile_timeout_grace_seconds,
        )
        profiles[node_type] = outcome.status
        events += outcome.events
    return profiles, events


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
def on_service_change(body: kopf.Body, patch: kopf.Patch, logger: logging.Logger, **_: Any) -> None:
    reconcile(_plain(body), patch, logger)


@kopf.timer(*RESOURCE, interval=CONFIG.reconcile_seconds)
def reconcile_timer(body: kopf.Body, patch: kopf.Patch, logger: logging.Logger, **_: Any) -> None:
    reconcile(_plain(body), patch, logger)


@kopf.timer(*RESOURCE, interval=CONFIG.autoscale_tick_seconds)
def autoscale_timer(
    body: kopf.Body, patch: kopf.Patch, logger: logging.Logger, stopped: kopf.DaemonStopped, **_: Any
) -> None:
    plain = _plain(body)
    try:
        spec = ServiceSpec.model_validate(plain["spec"])
    except pydantic.ValidationError:
        return  # reconcile reports it
    # A RayService holds every tier's replicas in one field that both passes rewrite: under the
    # reconcile lock, neither puts back a count the other just changed.
    rayservice = spec.runtime == "rayservice"
    with _RECONCILE_LOCKS[plain["metadata"]["uid"]] if rayservice else contextlib.nullcontext():
        outcome = autoscale_service(
            _State.kube, plain, spec, CONFIG, _State.source, _State.profile_cache, time.time()
        )
    if stopped:  # deleted while this pass ran: leave no metric series behind
        forget_service(
            plain["metadata"]["namespace"], plain["metadata"]["name"], [t.name for t in spec.tiers]
        )
        return
    _post(plain, outcome.events)
    for event in outcome.events:
        logger.info("%s: %s", event.reason, event.message)
    if outcome.tiers:
        patch.status["tiers"] = outcome.tiers
        patch.status["replicasSummary"] = outcome.summary
    if outcome.metrics_error is not None:
        _report_metrics_health(plain, outcome.metrics_error, patch)


def _report_metrics_health(body: dict[str, Any], error: str, patch: kopf.Patch) -> None:
    """The MetricsAvailable condition, and an event when it changes (not at every pass)."""
    old_conditions = list((body.get("status") or {}).get("conditions") or [])
    uid = body["metadata"]["uid"]
    previous = _METRICS_CONDITIONS.get(uid) or next(
        (c for c in old_conditions if c.get("type") == METRICS_CONDITION), None
    )
    ok = not error
    if previous is not None and (previous.get("status") == "True") == ok:
        _METRICS_CONDITIONS[uid] = previous
        return
    reason, message = ("Readable", "") if ok else ("Unavailable", f"{error}; replicas held")
    metrics = condition([previous] if previous else [], METRICS_CONDITION, ok, reason, message)
    _METRICS_CONDITIONS[uid] = metrics
    patch.status["conditions"] = [c for c in old_conditions if c.get("type") != METRICS_CONDITION] + [metrics]
    if not ok:
        _post(body, [Event("Warning", "MetricsUnavailable", message)])
    elif previous is not None:
        _post(body, [Event("Normal", "MetricsAvailable", "metrics readable again; autoscaling resumed")])


@kopf.on.event(*RESOURCE)
def on_service_event(event: dict[str, Any], body: kopf.Body, **_: Any) -> None:
    """Drop the deleted service's metric series; Kubernetes' garbage collector removes its objects."""
    if event.get("type") == "DELETED":
        _RECONCILE_LOCKS.pop(body["metadata"].get("uid", ""), None)
        _METRICS_CONDITIONS.pop(body["metadata"].get("uid", ""), None)
        tiers = [t.get("name") for t in (body.get("spec") or {}).get("tiers") or []]
        forget_service(body["metadata"]["namespace"], body["metadata"]["name"], tiers)


def _plain(body: kopf.Body) -> dict[str, Any]:
    """kopf's Body as plain dicts, as the builders expect."""
    return copy.deepcopy(dict(body))
