"""The end-of-run report: SLA checks, summary, the server's own view; written as JSON next to Locust's."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from dspark_loadtest.server_metrics import ServerView
from dspark_loadtest.sla import RunSummary, evaluate, format_table, summarize
from dspark_loadtest.stream import RequestSample
from dspark_loadtest.tiers import Tier


def build_report(tier: Tier, samples: list[RequestSample], server: ServerView | None, host: str) -> dict:
    summary = summarize(samples)
    checks = evaluate(tier, summary)
    return {
        "tier": tier.model_dump(by_alias=True),
        "host": host,
        "passed": all(c.passed for c in checks),
        "checks": [asdict(c) for c in checks],
        "table": format_table(tier.name, checks),
        "summary": {**asdict(summary), "error_ratio": summary.error_ratio},
        "server": None
        if server is None
        else {
            **asdict(server),
            "acceptance_rate": server.acceptance_rate,
            "mean_accepted_per_draft": server.mean_accepted_per_draft,
        },
        "ttft_agreement": ttft_agreement(summary, server),
    }


def ttft_agreement(summary: RunSummary, server: ServerView | None) -> dict | None:
    """Client mean TTFT minus the server's (from its histogram's sum/count over the same run)."""
    if server is None or server.ttft_mean_s is None or summary.ttft_mean_s is None:
        return None
    return {
        "client_mean_s": summary.ttft_mean_s,
        "server_mean_s": server.ttft_mean_s,
        "difference_s": summary.ttft_mean_s - server.ttft_mean_s,
        "client_p50_s": summary.ttft_p50_s,
        "server_p50_s": server.ttft_p50_s,
        "client_requests": summary.ttft_count,
        "server_requests": server.requests,
    }


def write_report(prefix: str | Path, report: dict, samples: list[RequestSample]) -> tuple[Path, Path]:
    """`<prefix>_sla.json` (the report) and `<prefix>_samples.jsonl` (one raw sample per line)."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    report_path = prefix.with_name(prefix.name + "_sla.json")
    samples_path = prefix.with_name(prefix.name + "_samples.jsonl")
    report_path.write_text(json.dumps(report, indent=2, default=float) + "\n")
    with samples_path.open("w") as f:
        for s in samples:
            f.write(json.dumps(s.to_json()) + "\n")
    return report_path, samples_path
