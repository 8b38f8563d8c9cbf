"""SLA checks computed from the raw per-request samples at the end of a run."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark_loadtest.stream import RequestSample
from dspark_loadtest.tiers import Tier


def percentile(values: list[float], q: float) -> float | None:
    """Exact percentile (linear interpolation between order statistics) of the raw values."""
    return float(np.percentile(values, q)) if values else None


@dataclass
class Check:
    name: str
    target: str  # e.g. ">= 60"
    measured: float | None
    passed: bool
    detail: str = ""


@dataclass
class RunSummary:
    """Aggregates of one run from its raw samples.

    Requests still streaming when the run ended (`cut`) are neither successes nor failures, but
    their TTFT, speed and tokens so far count: leaving them out would drop the slowest requests.
    """

    requests: int  # finished, successfully or not
    failures: int
    cut: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    ttft_mean_s: float | None
    ttft_count: int
    tpot_p50_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    tokens_per_s_p50: float | None
    tokens_per_s_p10: float | None
    output_tokens: int
    tokens_per_chunk_mean: float | None
    aggregate_tokens_per_s: float | None  # all output tokens over the span of the measured requests

    @property
    def error_ratio(self) -> float:
        return self.failures / self.requests if self.requests else 0.0


def summarize(samples: list[RequestSample]) -> RunSummary:
    finished = [s for s in samples if not s.cut]
    ok = [s for s in finished if s.ok]
    measured = [s for s in samples if s.ok or (s.cut and s.e2e_s is not None)]
    ttft = [s.ttft_s for s in measured if s.ttft_s is not None]
    tpot = [s.tpot_s for s in measured if s.tpot_s is not None]
    tps = [s.tokens_per_s for s in measured if s.tokens_per_s is not None]
    itl = [g for s in measured for g in s.itl_s]
    tokens = sum(s.output_tokens for s in measured)
    chunks = sum(s.chunks for s in measured)
    span = (max(s.start + s.e2e_s for s in measured) - min(s.start for s in measured)) if measured else 0.0
    return RunSummary(
        requests=len(finished),
        failures=len(finished) - len(ok),
        cut=len(samples) - len(finished),
        ttft_p50_s=percentile(ttft, 50),
        ttft_p95_s=percentile(ttft, 95),
        ttft_mean_s=float(np.mean(ttft)) if ttft else None,
        ttft_count=len(ttft),
        tpot_p50_s=percentile(tpot, 50),
        itl_p50_s=percentile(itl, 50),
        itl_p99_s=percentile(itl, 99),
        tokens_per_s_p50=percentile(tps, 50),
        tokens_per_s_p10=percentile(tps, 10),
        output_tokens=tokens,
        tokens_per_chunk_mean=tokens / chunks if chunks else None,
        aggregate_tokens_per_s=tokens / span if span > 0 else None,
    )


def evaluate(tier: Tier, summary: RunSummary) -> list[Check]:
    """The tier's checks; a missing measurement (no successful request) fails its check."""

    def at_least(name: str, measured: float | None, target: float) -> Check:
        return Check(name, f">= {target:g}", measured, measured is not None and measured >= target)

    def at_most(name: str, measured: float | None, target: float) -> Check:
        return Check(name, f"<= {target:g}", measured, measured is not None and measured <= target)

    checks = [
        Check(
            "successful requests",
            ">= 1",
            float(summary.requests - summary.failures),
            summary.requests > summary.failures,
        ),
        at_least("tokens/s per user p50", summary.tokens_per_s_p50, tier.tokens_per_second_per_user),
    ]
    if tier.tokens_per_second_per_user_p10 is not None:
        checks.append(
            at_least("tokens/s per user p10", summary.tokens_per_s_p10, tier.tokens_per_second_per_user_p10)
        )
    checks.append(at_most("TTFT p95 (s)", summary.ttft_p95_s, tier.ttft_p95_seconds))
    checks.append(
        Check(
            "error ratio",
            f"<= {tier.max_error_ratio:g}",
            summary.error_ratio,
            summary.error_ratio <= tier.max_error_ratio,
            f"{summary.failures} of {summary.requests} requests failed",
        )
    )
    return checks


def format_table(tier_name: str, checks: list[Check]) -> str:
    """A plain-text pass/fail table, one row per check, and the verdict."""
    rows = [
        (c.name, c.target, "-" if c.measured is None else f"{c.measured:.4g}", "PASS" if c.passed else "FAIL")
        for c in checks
    ]
    header = ("check", "target", "measured", "result")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [
        f"SLA tier {tier_name!r}",
        *(line.format(*r).rstrip() for r in [header, ["-" * w for w in widths], *rows]),
    ]
    verdict = "PASS" if all(c.passed for c in checks) else "FAIL"
    out.append(f"verdict: {verdict}")
    return "\n".join(out)
