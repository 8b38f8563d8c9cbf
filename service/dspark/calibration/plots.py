"""Reliability diagram of the cumulative survival probability, one panel per block position."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from dspark.calibration.metrics import DEFAULT_BINS, expected_calibration_error, reliability_bins, roc_auc
from dspark.calibration.rounds import RoundLog, cumulative_confidence


def plot_reliability(
    rounds: RoundLog,
    temperatures: list[float],
    path: str | Path,
    title: str = "",
    bins: int = DEFAULT_BINS,
    offsets: list[float] | None = None,
    calibrated: np.ndarray | None = None,
) -> Path:
    """Observed prefix survival against predicted a_k before (raw) and after calibration
    (`calibrated`, e.g. out-of-fold predictions, replaces the map's a_k)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    survived, observed = rounds.survival()
    curves = {
        "raw": cumulative_confidence(rounds.conf_logits),
        "calibrated (STS)": calibrated
        if calibrated is not None
        else cumulative_confidence(rounds.conf_logits, temperatures, offsets),
    }
    cols = min(4, rounds.gamma)
    rows = math.ceil(rounds.gamma / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
    for k, ax in enumerate(axes.ravel()):
        if k >= rounds.gamma:
            ax.axis("off")
            continue
        seen = observed[:, k]
        ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls=":")
        eces = []
        for (label, probs), marker in zip(curves.items(), ("o", "s"), strict=True):
            r = reliability_bins(probs[seen, k], survived[seen, k], bins)
            used = r.count > 0
            ax.plot(r.confidence[used], r.frequency[used], marker=marker, ms=3, lw=1.2, label=label)
            eces.append(expected_calibration_error(probs[seen, k], survived[seen, k], bins))
        # Shaded: where the calibrated predictions fall (share of rounds per bin).
        hist = ax.twinx()
        hist.bar(
            r.edges[:-1],
            r.count / max(r.count.sum(), 1),
            width=1 / bins,
            align="edge",
            color="0.5",
            alpha=0.15,
        )
        hist.set_ylim(0, 1)
        hist.set_yticks([])
        auc = roc_auc(curves["calibrated (STS)"][seen, k], survived[seen, k])
        ax.set_title(
            f"position {k + 1}: T={temperatures[k]:.2f}"
            + (f", b={offsets[k]:+.2f}" if offsets is not None else "")
            + f", n={int(seen.sum())}\n"
            f"ECE {eces[0] * 100:.1f}% -> {eces[1] * 100:.1f}%, AUC {auc:.3f}",
            fontsize=8,
        )
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("predicted a_k", fontsize=8)
        if k % cols == 0:
            ax.set_ylabel("observed survival of 1..k", fontsize=8)
        ax.tick_params(labelsize=7)
    axes.ravel()[0].legend(fontsize=7, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
