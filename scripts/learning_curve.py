"""Learning curves of drafters trained side by side: tau against training tokens seen.

Usage: python scripts/learning_curve.py RUN_DIR
RUN_DIR holds `acceptance/acceptance.json` (`dspark bench acceptance` over the drafters' exports
`train/KIND/step-NNNNNN/`, whose training.json gives the step and `tokens_seen`). Writes
RUN_DIR/learning_curve.json (every point, and the conditional acceptance by position at the last
one) and RUN_DIR/learning_curve.png (one panel per temperature, one line per drafter).
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
                "kind": run["kind"],
                "temperature": run["temperature"],
                "gamma": run["gamma"],
                "macro_tau": run["macro_tau"],
                "tau": {d: m["tau"] for d, m in run["domains"].items()},
            }
        )
    if not points:
        raise SystemExit(f"{run_dir}/acceptance/acceptance.json holds no runs")
    last = max(p["step"] for p in points)
    conditional = [
        {
            "kind": run["kind"],
            "temperature": run["temperature"],
            "conditional": {d: m["conditional"] for d, m in run["domains"].items()},
        }
        for run, point in zip(report["runs"], points, strict=True)
        if point["step"] == last
    ]
    return {"points": points, "last_point_conditional_acceptance": conditional}


def plot(curves: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    temperatures = sorted({p["temperature"] for p in curves["points"]})
    fig, axes = plt.subplots(1, len(temperatures), figsize=(5 * len(temperatures), 4), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures, strict=True):
        for kind in ("dspark", "dflash", "eagle3"):
            rows = sorted(
                (p["tokens"], p["macro_tau"])
                for p in curves["points"]
                if p["kind"] == kind and p["temperature"] == temperature
            )
            if rows:
                ax.plot([r[0] for r in rows], [r[1] for r in rows], marker="o", label=kind)
        ax.set_title(f"T = {temperature:g}, block 7, whole block verified")
        ax.set_xlabel("training response tokens seen")
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
    args = parser.parse_args()
    curves = collect(args.run_dir)
    (args.run_dir / "learning_curve.json").write_text(json.dumps(curves, indent=2) + "\n")
    plot(curves, args.run_dir / "learning_curve.png")
    for p in curves["points"]:
        print(
            f"step {p['step']:>6} tokens {p['tokens']:>9} {p['kind']:<7} T={p['temperature']:g} tau {p['macro_tau']:.3f}"
        )


if __name__ == "__main__":
    main()
