"""One autoscaling pass over a service's tiers: read metrics, decide, fit the budget, patch."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from dspark.sps_format import SpsProfile
from prometheus_client import Gauge

from dspark_operator import builders, ray_builders
from dspark_operator.config import OperatorConfig
from dspark_operator.kube import Kube
from dspark_operator.metrics import MetricsUnavailable, PodMetricsReader, PrometheusMetricsReader
from dspark_operator.profiling import Event
from dspark_operator.scaling import (
    CapacityModel,
    Decision,
    ScalingMemory,
    ScalingPolicy,
    TierMetrics,
    TierTarget,
    apportion_by_priority,
    decide,
)
from dspark_operator.serving import set_workload_replicas, workload_replicas
from dspark_operator.spec import ServiceSpec, TierSpec

# Not `namespace` or `service`: Prometheus gives every scraped series its target's (the operator's
# pod) and would rename these to exported_*. The names are those the serving series get from the
# chart's ServiceMonitor relabelings.
DESIRED_REPLICAS = Gauge(
    "dspark_desired_replicas",
    "Replicas the DSpark operator wants for a service tier",
    ["dspark_namespace", "dspark_service", "dspark_tier"],
)


class TierMetricsSource(Protocol):
    def read_tier(
        self, kube: Kube, namespace: str, service: str, tier: str, kind: str
    ) -> TierMetrics | None: ...


class PodsSource:
    """Scrape the tier's ready pods directly; a RayService tier, its application's `/metrics`."""

    def __init__(self) -> None:
        self.reader = PodMetricsReader()

    def read_tier(self, kube: Kube, namespace: str, service: str, tier: str, kind: str) -> TierMetrics | None:
        if kind == ray_builders.KIND:
            urls = [url] if (url := _application_metrics_url(kube, namespace, service, tier)) else []
        else:
            pods = kube.list("Pod", namespace, {builders.LABEL_SERVICE: service, builders.LABEL_TIER: tier})
            urls = [url for pod in pods if (url := _metrics_url(pod))]
        return self.reader.read((namespace, service, tier), urls)


class PrometheusSource:
    """Prometheus' series of the tier's pods. A RayService's pods hold replicas of every tier, so
    no series carries a tier: those tiers' applications are scraped directly."""

    def __init__(self, url: str, window: str) -> None:
        self.reader = PrometheusMetricsReader(url, window)
        self.direct = PodsSource()

    def read_tier(self, kube: Kube, namespace: str, service: str, tier: str, kind: str) -> TierMetrics | None:
        if kind == ray_builders.KIND:
            return self.direct.read_tier(kube, namespace, service, tier, kind)
        return self.reader.read(namespace, service, tier)


def metrics_source(config: OperatorConfig) -> TierMetricsSource:
    if config.prometheus_url:
        return PrometheusSource(config.prometheus_url, config.prometheus_window)
    return PodsSource()


def _application_metrics_url(kube: Kube, namespace: str, service: str, tier: str) -> str | None:
    """The tier application's /metrics behind KubeRay's Serve Service (its route prefix /<tier>)."""
    svc = kube.get("Service", namespace, ray_builders.serve_service_name(service))
    ip = ((svc or {}).get("spec") or {}).get("clusterIP")
    if not ip or ip == "None":
        return None
    ports = svc["spec"].get("ports") or []
    port = next((p["port"] for p in ports if p.get("name") == "serve"), ports[0]["port"] if ports else 8000)
    return f"http://{ip}:{port}/{tier}/metrics"


def _metrics_url(pod: dict[str, Any]) -> str | None:
    status = pod.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    if status.get("phase") != "Running" or not ready or not status.get("podIP"):
        return None
    ports = [
        p for c in pod["spec"].get("containers", []) for p in c.get("ports") or [] if p.get("name") == "http"
    ]
    return f"http://{status['podIP']}:{ports[0]['containerPort'] if ports else 8000}/metrics"


@dataclass(frozen=True)
class TierEvaluation:
    """One tier's decision this pass, with what applying it needs."""

    decision: Decision
    memory: ScalingMemory  # the tier's memory before this pass
    kind: str  # the workload's kind and name
    workload: str
    metrics: TierMetrics | None


@dataclass
class AutoscaleOutcome:
    tiers: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    summary: str = ""
    # Why the metrics could not be read this pass; "" when they could, None when no tier was due.
    metrics_error: str | None = None


def _capacity(
    kube: Kube, namespace: str, configmap: str, config: OperatorConfig, cache: dict
) -> CapacityModel | None:
    cm = kube.get("ConfigMap", namespace, configmap)
    if cm is None:
        return None
    raw = cm["data"][builders.PROFILE_KEY]
    if cache.get(configmap, (None,))[0] != raw:
        cache[configmap] = (raw, SpsProfile.model_validate_json(raw))
    return CapacityModel(cache[configmap][1], config.default_accepted_per_step, config.default_verify_tokens)


def autoscale_service(
    kube: Kube,
    body: dict[str, Any],
    spec: ServiceSpec,
    config: OperatorConfig,
    source: TierMetricsSource,
    profile_cache: dict,
    now: float,
) -> AutoscaleOutcome:
    """One pass: decide each tier that is due, fit the decisions into the replica budget, apply them."""
    run = _AutoscalePass(
        kube,
        body["metadata"]["namespace"],
        body["metadata"]["name"],
        spec,
        config,
        source,
        profile_cache,
        now,
    )
    tier_status: dict[str, Any] = (body.get("status") or {}).get("tiers") or {}
    evaluations: dict[str, TierEvaluation] = {}
    for tier in spec.tiers:
        status = tier_status.get(tier.name) or {}
        if _due(status, spec.autoscaling.interval_seconds, now) and (
            evaluation := run.evaluate(tier, status)
        ):
            evaluations[tier.name] = evaluation
    granted = apportion_by_priority(
        {t: e.decision.desired for t, e in evaluations.items()},
        {t.name: t.min_replicas for t in spec.tiers},
        {t.name: t.priority for t in spec.tiers},
        spec.autoscaling.max_total_replicas,
    )
    for tier_name, evaluation in evaluations.items():
        run.outcome.tiers[tier_name] = run.apply(tier_name, evaluation, granted[tier_name])
    run.outcome.summary = _summary(spec, tier_status, run.outcome.tiers)
    return run.outcome


def _due(status: dict[str, Any], interval_seconds: float, now: float) -> bool:
    """A deployed tier not evaluated within the last interval."""
    last = status.get("lastEvaluated")
    return status.get("state") == "Deployed" and (last is None or now - float(last) >= interval_seconds)


@dataclass
class _AutoscalePass:
    """What one pass over a service reads and writes, and its outcome so far."""

    kube: Kube
    namespace: str
    service: str
    spec: ServiceSpec
    config: OperatorConfig
    source: TierMetricsSource
    profile_cache: dict
    now: float
    outcome: AutoscaleOutcome = field(default_factory=AutoscaleOutcome)

    def evaluate(self, tier: TierSpec, status: dict[str, Any]) -> TierEvaluation | None:
        """The tier's decision from its workload, profile and metrics (None: no workload yet)."""
        kind, name = status["kind"], status["workload"]
        current = workload_replicas(self.kube, kind, self.namespace, name, tier.name)
        if current is None:
            return None  # the reconciler has not created it yet
        memory = ScalingMemory.from_status(status)
        if memory.last_scale_time is None:
            # A new workload counts as just scaled, so nothing scales down before one cool-down.
            memory = replace(memory, last_scale_time=self.now)
        configmap = builders.profile_configmap_name(self.service, status["nodeType"])
        capacity = _capacity(self.kube, self.namespace, configmap, self.config, self.profile_cache)
        metrics = self._read_metrics(tier.name, kind)
        target = TierTarget(
            tier.tokens_per_second_per_user, tier.ttft_p95_seconds, tier.min_replicas, tier.max_replicas
        )
        # Without metrics, decide() only keeps the tier inside its bounds: the replicas hold.
        decision = decide(current, metrics, target, capacity, self.policy(), memory, self.now)
        error = self.outcome.metrics_error
        if error and decision.desired == current:
            decision = replace(decision, reason=f"held: metrics unavailable ({error})")
        return TierEvaluation(decision, memory, kind, name, metrics)

    def policy(self) -> ScalingPolicy:
        a = self.spec.autoscaling
        return ScalingPolicy(
            a.tolerance, a.scale_up_cooldown_seconds, a.scale_down_cooldown_seconds, a.max_scale_up_factor
        )

    def _read_metrics(self, tier: str, kind: str) -> TierMetrics | None:
        """The tier's metrics; after one failure this pass, the other tiers do not wait on it."""
        if self.outcome.metrics_error:
            return None
        try:
            metrics = self.source.read_tier(self.kube, self.namespace, self.service, tier, kind)
        except MetricsUnavailable as exc:
            self.outcome.metrics_error = str(exc)
            return None
        self.outcome.metrics_error = ""
        return metrics

    def apply(self, tier: str, evaluation: TierEvaluation, desired: int) -> dict[str, Any]:
        """Scale the tier's workload to the `desired` replicas the budget granted; its status fields."""
        decision, old_memory, metrics = evaluation.decision, evaluation.memory, evaluation.metrics
        reason, memory = decision.reason, decision.memory
        if desired != decision.desired:
            reason += f"; limited to {desired} by maxTotalReplicas {self.spec.autoscaling.max_total_replicas}"
        if desired == decision.current:  # no scaling happened: the cool-down clock keeps running
            memory = replace(
                memory, last_scale_time=old_memory.last_scale_time, last_direction=old_memory.last_direction
            )
        else:
            set_workload_replicas(
                self.kube, evaluation.kind, self.namespace, evaluation.workload, tier, desired
            )
            verb = "ScaledUp" if desired > decision.current else "ScaledDown"
            message = f"tier {tier}: {decision.current} -> {desired}: {reason}"
            self.outcome.events.append(Event("Normal", verb, message))
        DESIRED_REPLICAS.labels(self.namespace, self.service, tier).set(desired)
        return {
            "currentReplicas": decision.current,
            "desiredReplicas": desired,
            "recommendation": decision.recommendation,
            "lastTokensPerSecond": metrics.tokens_per_second_p50 if metrics else None,
            "lastTtftP95Seconds": metrics.ttft_p95_seconds if metrics else None,
            "lastDecision": reason,
            "lastEvaluated": self.now,
            **memory.to_status(),
        }


def _summary(spec: ServiceSpec, old: dict[str, Any], evaluated: dict[str, dict[str, Any]]) -> str:
    """'tier current/desired, ...' over every tier, this pass's figures over the status's."""
    merged = {t: dict(s) for t, s in old.items()}
    for t, s in evaluated.items():
        merged.setdefault(t, {}).update(s)
    return ", ".join(
        f"{t.name} {merged.get(t.name, {}).get('currentReplicas', '-')}/{merged.get(t.name, {}).get('desiredReplicas', '-')}"
        for t in spec.tiers
    )


def forget_service(namespace: str, service: str, tiers: list[str]) -> None:
    for tier in tiers:
        with contextlib.suppress(KeyError):
            DESIRED_REPLICAS.remove(namespace, service, tier)
