"""PNG plots of `dspark bench acceptance`: per-position acceptance and the confidence-threshold sweep."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(s: dict, with_gamma: bool) -> str:
    return f"{s['drafter']} (gamma {s['gamma']})" if with_gamma else s["drafter"]


def plot_per_position(summaries: list[dict], path: str | Path) -> Path:
    """Rows: temperatures; columns: domains; conditional acceptance solid, unconditional dashed."""
    plt = _pyplot()
    temperatures = sorted({s["temperature"] for s in summaries}, reverse=True)
    domains = list(dict.fromkeys(d for s in summaries for d in s["domains"]))
    with_gamma = len({s["gamma"] for s in summaries}) > 1
    fig, axes = plt.subplots(
        len(temperatures), len(domains), figsize=(4 * len(domains), 3.2 * len(temperatures)), squeeze=False
    )
    colors = {}
    for row, temperature in enumerate(temperatures):
        for col, domain in enumerate(domains):
            ax = axes[row, col]
            for s in summaries:
                if s["temperature"] != temperature or domain not in s["domains"]:
                    continue
                m = s["domains"][domain]
                label = _label(s, with_gamma)
                k = range(1, len(m["conditional"]) + 1)
                (line,) = ax.plot(k, m["conditional"], marker="o", ms=3, color=colors.get(label), label=label)
                colors[label] = line.get_color()
                ax.plot(k, m["unconditional"], ls="--", marker=".", ms=3, color=line.get_color())
            ax.set_title(f"{domain}, temperature {temperature:g}", fontsize=9)
            ax.set_ylim(0, 1.02)
            ax.set_xlabel("draft position k", fontsize=8)
            if col == 0:
                ax.set_ylabel("acceptance (solid: conditional, dashed: unconditional)", fontsize=7)
            ax.tick_params(labelsize=7)
    axes[0, 0].legend(fontsize=7)
    return _save(fig, plt, path)


def plot_threshold_sweep(summaries: list[dict], path: str | Path) -> Path:
    """Per domain: acceptance rate and tokens per round against the confidence threshold
    (drafters with confidences, highest temperature)."""
    plt = _pyplot()
    with_conf = [s for s in summaries if any("threshold_sweep" in m for m in s["domains"].values())]
    if with_conf:
        top = max(s["temperature"] for s in with_conf)
        with_conf = [s for s in with_conf if s["temperature"] == top]
    domains = list(dict.fromkeys(d for s in with_conf for d in s["domains"])) or ["(none)"]
    with_gamma = len({s["gamma"] for s in with_conf}) > 1
    fig, axes = plt.subplots(2, len(domains), figsize=(4 * len(domains), 6), squeeze=False)
    for col, domain in enumerate(domains):
        for s in with_conf:
            sweep = s["domains"].get(domain, {}).get("threshold_sweep")
            if not sweep:
                continue
            x = [r["threshold"] for r in sweep]
            label = _label(s, with_gamma)
            axes[0, col].plot(x, [r["acceptance_rate"] for r in sweep], marker="o", ms=3, label=label)
            axes[1, col].plot(x, [r["tokens_per_round"] for r in sweep], marker="o", ms=3, label=label)
        axes[0, col].set_title(f"{domain}", fontsize=9)
        axes[0, col].set_ylabel("acceptance rate (accepted / verified)", fontsize=7)
        axes[1, col].set_ylabel("tokens per round", fontsize=7)
        axes[1, col].set_xlabel("confidence threshold x", fontsize=8)
        for ax in axes[:, col]:
            ax.tick_params(labelsize=7)
    if with_conf:
        axes[0, 0].legend(fontsize=7)
        fig.suptitle(f"confidence-threshold sweep, temperature {with_conf[0]['temperature']:g}", fontsize=10)
    else:
        fig.suptitle("no drafter with a confidence head", fontsize=10)
    return _save(fig, plt, path)


def _save(fig, plt, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
