"""Learning curves of drafters trained side by side: tau against training tokens seen.

Usage: python scripts/learning_curve.py RUN_DIR [--by run --x seconds]
RUN_DIR holds `acceptance/acceptance.json` (`dspark bench acceptance` over the drafters' exports
`train/KIND/step-NNNNNN/`, whose training.json gives the step, `tokens_seen` and `train_wall_s`).
Writes RUN_DIR/learning_curve.json (every point, and the conditional acceptance by position at the
last one) and RUN_DIR/learning_curve.png (one panel per temperature, one line per drafter kind, or
with `--by run` per training run: recipes of one drafter compared at equal training time).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def collect(run_dir: Path) -> dict:
    report = json.loads((run_dir / "acceptance" / "acceptance.json").read_text())
    points = []
    for run in report["runs"]:
        export = Path(run["drafter"])  # RUN_DIR/train/KIND/step-NNNNNN
        info = json.loads((export / "training.json").read_text())
        points.append(
            {
                "step": info["steps"],
                "tokens": info["tokens_seen"],
                "seconds": info.get("train_wall_s"),
                "kind": run["kind"],
                "run": export.parent.name,
                "temperature": run["temperature"],
                "gamma": run["gamma"],
                "macro_tau": run["macro_tau"],
                "tau": {d: m["tau"] for d, m in run["domains"].items()},
            }
        )
    if not points:
        raise SystemExit(f"{run_dir}/acceptance/acceptance.json holds no runs")
    last = {}
    for p in points:
        last[p["run"]] = max(last.get(p["run"], 0), p["step"])
    conditional = [
        {
            "kind": run["kind"],
            "run": point["run"],
            "step": point["step"],
            "temperature": run["temperature"],
            "conditional": {d: m["conditional"] for d, m in run["domains"].items()},
        }
        for run, point in zip(report["runs"], points, strict=True)
        if point["step"] == last[point["run"]]
    ]
    return {"points": points, "last_point_conditional_acceptance": conditional}


X_LABELS = {"tokens": "training response tokens seen", "seconds": "training wall time (s)"}


def references(path: Path) -> list[dict]:
    """Each drafter of another `acceptance.json` (e.g. the warm start), drawn as a level line."""
    report = json.loads(path.read_text())
    return [
        {"name": r["drafter"], "temperature": r["temperature"], "macro_tau": r["macro_tau"]}
        for r in report["runs"]
    ]


def plot(
    curves: dict,
    path: Path,
    by: str = "kind",
    x: str = "tokens",
    labels: dict[str, str] | None = None,
    levels: list[dict] | None = None,
) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    temperatures = sorted({p["temperature"] for p in curves["points"]})
    fig, axes = plt.subplots(1, len(temperatures), figsize=(5 * len(temperatures), 4), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures, strict=True):
        lines = sorted({p[by] for p in curves["points"]})
        for line in lines:
            rows = sorted(
                (p[x], p["macro_tau"])
                for p in curves["points"]
                if p[by] == line and p["temperature"] == temperature
            )
            if rows:
                ax.plot(
                    [r[0] for r in rows],
                    [r[1] for r in rows],
                    marker="o",
                    label=(labels or {}).get(line, line),
                )
        for level in levels or []:
            if level["temperature"] == temperature:
                ax.axhline(
                    level["macro_tau"], linestyle="--", color="gray", label=f"{level['name']} (reference)"
                )
        ax.set_title(f"T = {temperature:g}, block 7, whole block verified")
        ax.set_xlabel(X_LABELS[x])
        ax.set_ylabel("macro tau (held-out bench split)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument(
        "--by", choices=["kind", "run"], default="kind", help="One line per drafter kind or run."
    )
    parser.add_argument("--x", choices=sorted(X_LABELS), default="tokens")
    parser.add_argument("--label", action="append", default=[], help="RUN=NAME: a line's legend entry.")
    parser.add_argument(
        "--reference", type=Path, help="An acceptance.json drawn as level lines (e.g. the warm start)."
    )
    args = parser.parse_args()
    curves = collect(args.run_dir)
    levels = references(args.reference) if args.reference else []
    if levels:
        curves["references"] = levels
    (args.run_dir / "learning_curve.json").write_text(json.dumps(curves, indent=2) + "\n")
    labels = dict(item.split("=", 1) for item in args.label)
    plot(curves, args.run_dir / "learning_curve.png", args.by, args.x, labels, levels)
    for p in curves["points"]:
        print(
            f"{p['run']:<12} step {p['step']:>6} tokens {p['tokens']:>9} {p['seconds'] or 0:>8.0f} s "
            f"{p['kind']:<7} T={p['temperature']:g} tau {p['macro_tau']:.3f}"
        )


if __name__ == "__main__":
    main()
