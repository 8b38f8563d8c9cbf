"""The throughput-interactivity frontier: sweep concurrency, plot aggregate vs. per-user tokens/s.

Each (server, concurrency) point is one constant-load Locust run with the chosen tier's workload;
the tiers' per-user speed targets are drawn as anchors, so one can read off the highest aggregate
throughput a server sustains while still meeting a tier.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from dspark_loadtest.runner import run_scenario
from dspark_loadtest.tiers import Tier


@dataclass
class FrontierPoint:
    concurrency: int
    aggregate_tokens_per_s: float | None
    tokens_per_s_per_user_p50: float | None
    tokens_per_s_per_user_p10: float | None
    ttft_p95_s: float | None
    requests: int  # finished
    failures: int
    cut: int  # still streaming at the end; their tokens and speeds so far count


@dataclass
class Series:
    label: str
    host: str
    points: list[FrontierPoint]


def sweep(
    host: str, label: str, concurrency: list[int], seconds: float, out_dir: Path, options: dict[str, object]
) -> Series:
    points = []
    for c in concurrency:
        prefix = out_dir / "runs" / f"{_slug(label)}-c{c}"
        # Requests cut at the end still count (their tokens and speeds so far), so no long drain is needed.
        result = run_scenario(
            host,
            prefix,
            seconds,
            {**options, "concurrency": c, "scenario_seconds": seconds},
            stop_timeout_s=1,
        )
        report = result.report
        if report is None:  # an SLA breach still writes a report; no report means the run itself failed
            raise RuntimeError(
                f"frontier run {label} at concurrency {c} failed (exit {result.returncode}):\n"
                + result.output[-2000:]
            )
        s = report["summary"]
        points.append(
            FrontierPoint(
                c,
                s["aggregate_tokens_per_s"],
                s["tokens_per_s_p50"],
                s["tokens_per_s_p10"],
                s["ttft_p95_s"],
                s["requests"],
                s["failures"],
                s["cut"],
            )
        )
    return Series(label, host, points)


def write_frontier(series: list[Series], tiers: list[Tier], out_dir: Path, meta: dict) -> tuple[Path, Path]:
    """`frontier.json` (every point) and `frontier.png` (one curve per server, tier anchors)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / "frontier.json", out_dir / "frontier.png"
    doc = {
        **meta,
        "series": [asdict(s) for s in series],
        "tiers": [
            {
                "name": t.name,
                "tokensPerSecondPerUser": t.tokens_per_second_per_user,
                "tokensPerSecondPerUserP10": t.tokens_per_second_per_user_p10,
                "ttftP95Seconds": t.ttft_p95_seconds,
            }
            for t in tiers
        ],
    }
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    plot(series, tiers, png_path, meta.get("title", "Throughput-interactivity frontier"))
    return json_path, png_path


def plot(series: list[Series], tiers: list[Tier], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for s in series:
        pts = [p for p in s.points if p.aggregate_tokens_per_s and p.tokens_per_s_per_user_p50]
        xs = [p.tokens_per_s_per_user_p50 for p in pts]
        ys = [p.aggregate_tokens_per_s for p in pts]
        (line,) = ax.plot(xs, ys, marker="o", label=s.label)
        for p, x, y in zip(pts, xs, ys, strict=True):
            ax.annotate(
                f"c={p.concurrency}",
                (x, y),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
                color=line.get_color(),
            )
    for i, t in enumerate(sorted(tiers, key=lambda t: t.tokens_per_second_per_user)):
        ax.axvline(t.tokens_per_second_per_user, color="grey", linestyle="--", linewidth=0.8)
        ax.annotate(
            f"{t.name} ({t.tokens_per_second_per_user:g} tok/s p50)",
            (t.tokens_per_second_per_user, 1),
            xycoords=("data", "axes fraction"),
            xytext=(3, -12 - 10 * i),
            textcoords="offset points",
            fontsize=7,
            color="grey",
        )
    ax.set_xlabel("per-user tokens/s (p50)")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title(title)
    anchors = [t.tokens_per_second_per_user for t in tiers]
    ax.set_xlim(0, max([ax.get_xlim()[1], *(1.15 * a for a in anchors)]))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(loc="lower left", fontsize=8)  # frontiers fall to the right: that corner stays empty
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_concurrency(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"concurrency must be a comma-separated list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"concurrency needs positive integers, got {text!r}")
    return sorted(set(values))


def _slug(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in label) or "server"
