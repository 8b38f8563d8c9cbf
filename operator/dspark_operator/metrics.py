"""Reading a tier's serving metrics: from Prometheus when configured, else from the pods' /metrics."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from dspark_operator.scaling import TierMetrics

TOKENS_PER_USER = "dspark_request_tokens_per_second"
TTFT = "vllm:time_to_first_token_seconds"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"


class MetricsUnavailable(Exception):
    """The metrics backend cannot answer (Prometheus down, unreachable or failing its queries)."""


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket counts keyed by upper bound."""
    ordered = sorted(buckets.items())
    if not ordered or ordered[-1][1] <= 0:
        return None
    total = ordered[-1][1]
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound  # quantile lies in the overflow bucket: report the last finite bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


@dataclass
class MetricsSample:
    """Cumulative counters and histograms of one or more pods at one instant."""

    histograms: dict[str, dict[float, float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float))
    )
    counters: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    gauges: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, other: MetricsSample) -> None:
        for name, buckets in other.histograms.items():
            for bound, count in buckets.items():
                self.histograms[name][bound] += count
        for name, value in other.counters.items():
            self.counters[name] += value
        for name, value in other.gauges.items():
            self.gauges[name] += value


def parse_metrics_text(text: str) -> MetricsSample:
    """Parse a server's Prometheus exposition into the few series the autoscaler uses."""
    sample = MetricsSample()
    for family in text_string_to_metric_families(text):
        if family.name in (TOKENS_PER_USER, TTFT):
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    sample.histograms[family.name][float(s.labels["le"])] += s.value
        elif family.name.removesuffix("_total") in (DRAFTS, DRAFT_TOKENS, ACCEPTED_TOKENS):
            # Servers name the counter family with or without `_total`; the samples carry it.
            for s in family.samples:
                if s.name.endswith("_total"):
                    sample.counters[s.name.removesuffix("_total")] += s.value
        elif family.name in (RUNNING, WAITING):
            for s in family.samples:
                sample.gauges[family.name] += s.value
    return sample


def _delta(now: Mapping, before: Mapping | None) -> dict:
    """Counter increase since `before`; a pod restart (a decrease) falls back to the full value."""
    if before is None:
        return dict(now)
    out = {k: v - before.get(k, 0.0) for k, v in now.items()}
    return dict(now) if any(v < 0 for v in out.values()) else out


def tier_metrics_from_samples(current: MetricsSample, previous: MetricsSample | None) -> TierMetrics:
    """Interval metrics of a tier from two cumulative samples (or from the start, without `previous`)."""
    prev_h = previous.histograms if previous else {}
    tps = histogram_quantile(
        0.5, _delta(current.histograms.get(TOKENS_PER_USER, {}), prev_h.get(TOKENS_PER_USER))
    )
    ttft = histogram_quantile(0.95, _delta(current.histograms.get(TTFT, {}), prev_h.get(TTFT)))
    counters = _delta(current.counters, previous.counters if previous else None)
    drafts = counters.get(DRAFTS, 0.0)
    return TierMetrics(
        tokens_per_second_p50=tps,
        ttft_p95_seconds=ttft,
        requests_running=current.gauges.get(RUNNING, 0.0),
        requests_waiting=current.gauges.get(WAITING, 0.0),
        accepted_per_step=1 + counters.get(ACCEPTED_TOKENS, 0.0) / drafts if drafts > 0 else None,
        verify_tokens_per_request=1 + counters.get(DRAFT_TOKENS, 0.0) / drafts if drafts > 0 else None,
    )


class PodMetricsReader:
    """Scrapes `/metrics` of a tier's ready pods and diffs against the previous scrape.

    The previous samples live in memory only: after an operator restart the first interval
    uses cumulative histograms, which errs towards the long-run behaviour, not towards noise.
    """

    def __init__(self, timeout: float = 3.0) -> None:
        self._timeout = timeout
        self._previous: dict[tuple[str, ...], MetricsSample] = {}

    def read(self, key: tuple[str, ...], endpoints: Iterable[str]) -> TierMetrics | None:
        total, scraped = MetricsSample(), 0
        with httpx.Client(timeout=self._timeout) as client:
            for url in endpoints:
                try:
                    response = client.get(url)
                    response.raise_for_status()
                except httpx.HTTPError:
                    continue  # a pod that cannot answer is not counted; the others still are
                total.add(parse_metrics_text(response.text))
                scraped += 1
        if scraped == 0:
            return None
        metrics = tier_metrics_from_samples(total, self._previous.get(key))
        self._previous[key] = total
        return metrics

    def forget(self, key_prefix: tuple[str, ...]) -> None:
        for key in [k for k in self._previous if k[: len(key_prefix)] == key_prefix]:
            del self._previous[key]


class PrometheusMetricsReader:
    """Queries a Prometheus HTTP API for a tier's series over a rate window.

    Series are selected by the labels the chart's ServiceMonitor attaches:
    namespace, dspark_service and dspark_tier.
    """

    def __init__(self, url: str, window: str = "2m", timeout: float = 5.0) -> None:
        self._url = url.rstrip("/") + "/api/v1/query"
        self._window = window
        self._timeout = timeout

    def queries(self, namespace: str, service: str, tier: str) -> dict[str, str]:
        sel = f'namespace="{namespace}",dspark_service="{service}",dspark_tier="{tier}"'
        w = self._window

        def rate(name: str) -> str:
            return f"sum(rate({name}_total{{{sel}}}[{w}]))"

        return {
            "tps": f"histogram_quantile(0.5, sum by (le) (rate({TOKENS_PER_USER}_bucket{{{sel}}}[{w}])))",
            "ttft": f"histogram_quantile(0.95, sum by (le) (rate({TTFT}_bucket{{{sel}}}[{w}])))",
            "running": f"sum({RUNNING}{{{sel}}})",
            "waiting": f"sum({WAITING}{{{sel}}})",
            "tau": f"1 + {rate(ACCEPTED_TOKENS)} / {rate(DRAFTS)}",
            "verify": f"1 + {rate(DRAFT_TOKENS)} / {rate(DRAFTS)}",
        }

    def read(self, namespace: str, service: str, tier: str) -> TierMetrics | None:
        """The tier's metrics, None when it has no series yet; MetricsUnavailable when Prometheus
        cannot answer."""
        values: dict[str, float | None] = {}
        try:
            with httpx.Client(timeout=self._timeout) as client:
                for key, query in self.queries(namespace, service, tier).items():
                    response = client.get(self._url, params={"query": query})
                    response.raise_for_status()
                    values[key] = _scalar(response.json())
        except (httpx.HTTPError, ValueError, RuntimeError) as exc:  # ValueError: not JSON
            raise MetricsUnavailable(f"Prometheus at {self._url}: {exc}") from exc
        if values["running"] is None and values["tps"] is None:
            return None  # the tier has no series yet
        return TierMetrics(
            tokens_per_second_p50=values["tps"],
            ttft_p95_seconds=values["ttft"],
            requests_running=values["running"] or 0.0,
            requests_waiting=values["waiting"] or 0.0,
            accepted_per_step=values["tau"],
            verify_tokens_per_request=values["verify"],
        )


def _scalar(payload: Mapping) -> float | None:
    """The single value of an instant-vector answer; None when empty or NaN."""
    if payload.get("status") != "success":
        raise RuntimeError(f"Prometheus query failed: {payload.get('error', payload)}")
    result = payload.get("data", {}).get("result", [])
    if not result:
        return None
    value = float(result[0]["value"][1])
    return None if math.isnan(value) or math.isinf(value) else value
