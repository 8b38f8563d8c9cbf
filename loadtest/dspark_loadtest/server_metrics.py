"""The server's own view of a run: /metrics scraped before and after, as deltas.

With several replicas behind one address a scrape reaches one of them, so these figures describe
one replica; against a single local server they cover the whole run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import requests
from prometheus_client.parser import text_string_to_metric_families

Snapshot = dict[tuple[str, tuple[tuple[str, str], ...]], float]

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"


def scrape(base_url: str, timeout_s: float = 10.0) -> Snapshot | None:
    """Samples of the server's /metrics summed over `model_name`; None when it cannot be read."""
    try:
        r = requests.get(base_url.rstrip("/") + "/metrics", timeout=timeout_s)
        r.raise_for_status()
    except requests.RequestException:
        return None
    return parse(r.text)


def parse(text: str) -> Snapshot:
    out: Snapshot = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


def delta(before: Snapshot, after: Snapshot) -> Snapshot:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def histogram_mean(d: Snapshot, name: str) -> float | None:
    count = d.get((name + "_count", ()), 0.0)
    return d.get((name + "_sum", ()), 0.0) / count if count > 0 else None


def histogram_quantile(d: Snapshot, name: str, q: float) -> float | None:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding rank q."""
    buckets = sorted((float(dict(labels)["le"]), v) for (n, labels), v in d.items() if n == name + "_bucket")
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / max(
                count - lower_count, 1e-12
            )
        lower_bound, lower_count = bound, count
    return lower_bound


@dataclass
class ServerView:
    requests: float
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    itl_mean_s: float | None
    generation_tokens: float
    spec_decode_drafts: float
    spec_decode_draft_tokens: float
    spec_decode_accepted_tokens: float

    @property
    def acceptance_rate(self) -> float | None:
        return (
            self.spec_decode_accepted_tokens / self.spec_decode_draft_tokens
            if self.spec_decode_draft_tokens
            else None
        )

    @property
    def mean_accepted_per_draft(self) -> float | None:
        return self.spec_decode_accepted_tokens / self.spec_decode_drafts if self.spec_decode_drafts else None


def server_view(before: Snapshot, after: Snapshot) -> ServerView:
    d = delta(before, after)

    def total(name: str) -> float:
        return d.get((name, ()), 0.0)

    return ServerView(
        requests=total(TTFT + "_count"),
        ttft_mean_s=histogram_mean(d, TTFT),
        ttft_p50_s=histogram_quantile(d, TTFT, 0.5),
        ttft_p95_s=histogram_quantile(d, TTFT, 0.95),
        itl_mean_s=histogram_mean(d, ITL),
        generation_tokens=total("vllm:generation_tokens_total"),
        spec_decode_drafts=total("vllm:spec_decode_num_drafts_total"),
        spec_decode_draft_tokens=total("vllm:spec_decode_num_draft_tokens_total"),
        spec_decode_accepted_tokens=total("vllm:spec_decode_num_accepted_tokens_total"),
    )
