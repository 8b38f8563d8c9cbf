"""PNG plots of step curves (matplotlib, headless Agg backend)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dspark.policies.sps_curve import OnlineSps
    from dspark.sps_format import SpsProfile


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_sps_profile(
    profile: SpsProfile,
    path: str | os.PathLike[str],
    refined: OnlineSps | None = None,
    title: str | None = None,
) -> Path:
    """Measured SPS points, the interpolated lookup, and optionally an online-refined curve."""
    plt = _pyplot()
    xs = profile.batch_tokens()
    dense = torch.linspace(1, xs[-1] * 1.25, 512, dtype=torch.float64)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.plot(
        dense.tolist(), profile.sps(dense).tolist(), lw=1, color="tab:blue", label="lookup (interp./extrap.)"
    )
    ax.scatter(xs, profile.steps_per_second(), s=10, color="tab:blue", zorder=3, label="measured")
    if refined is not None:
        ax.plot(
            dense.tolist(), refined.sps(dense).tolist(), lw=1.2, color="tab:orange", label="online refined"
        )
    ax.axvline(xs[-1], color="grey", ls=":", lw=0.8)
    ax.set_xlabel("batch tokens B (verification forward)")
    ax.set_ylabel("steps per second SPS(B)")
    ax.set_title(title or f"{profile.model} · {profile.dtype} · {profile.device}")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    return _save(fig, plt, path)


def plot_lines(
    series: dict[str, tuple[list[float], list[float]]],
    path: str | os.PathLike[str],
    xlabel: str,
    ylabel: str,
    title: str = "",
    markers: bool = True,
) -> Path:
    """One line per named (x, y) series: the generic figure the benches share."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for name, (x, y) in series.items():
        ax.plot(x, y, marker="o" if markers else None, ms=3, lw=1.2, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if series:
        ax.legend()
    return _save(fig, plt, path)


def _save(fig, plt, path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path
