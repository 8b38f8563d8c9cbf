"""What `dspark calibrate` writes: calibration.json beside the drafter, a JSON report and a table."""

from __future__ import annotations

import json
from pathlib import Path

from dspark.calibration.sts import PositionReport


def format_table(reports: list[PositionReport]) -> str:
    lines = [
        f"{'pos':>3} {'rounds':>7} {'survive':>8} {'T_k':>7} {'b_k':>6} {'ECE before':>11} {'ECE after':>10} {'AUC':>6} {'AUC cal':>7}"
    ]
    for r in reports:
        lines.append(
            f"{r.position:>3} {r.rounds:>7} {r.survival_rate:>8.3f} {r.temperature:>7.3f} {r.offset:>6.2f} "
            f"{r.ece_before * 100:>10.2f}% {r.ece_after * 100:>9.2f}% {r.auc_before:>6.3f} {r.auc_after:>7.3f}"
        )
    return "\n".join(lines)


def write_calibration_report(
    path: str | Path,
    drafter_id: str,
    fit: list[PositionReport],
    check: list[PositionReport] | None,
    meta: dict,
) -> Path:
    """JSON with per-position temperatures and offsets, ECE before/after and AUC on the fitting rounds and, when
    given, on held-back check rounds (prompts the fit did not see)."""
    payload = {
        "drafter_id": drafter_id,
        "temperatures": [r.temperature for r in fit],
        "offsets": [r.offset for r in fit],
        "fit": [r.as_dict() for r in fit],
        "check": [r.as_dict() for r in check] if check is not None else None,
        "max_ece_after": max(r.ece_after for r in fit),
        "meta": meta,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
