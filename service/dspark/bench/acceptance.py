"""`dspark bench acceptance`: the paper's offline acceptance protocol.

Every drafter decodes the held-out bench prompts of each domain with the whole block verified every
round (policy `full`, no scheduler). From the recorded rounds (`RoundLog`, full blocks only: a
request's last round may be cut short by max_tokens) this module computes per domain

- tau = 1 + mean accepted draft tokens per round (the bonus token included),
- acceptance rate = accepted / verified draft tokens,
- per-position acceptance: unconditional P(accepted >= k) and conditional
  P(accepted >= k | accepted >= k - 1),
- a confidence-threshold sweep (SpecDec++ style): verify only the prefix up to the first position
  whose calibrated c_k falls below x; accepted = min(accepted of the full block, verified prefix),
  which is what the target would have accepted of that prefix,
- with a calibration, the ECE of the calibrated cumulative survival on these (disjoint) prompts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark.calibration.rounds import RoundLog, confidences
from dspark.calibration.sts import evaluate
from dspark.drafters.calibration import Calibration

THRESHOLDS = tuple(round(x, 2) for x in np.arange(0.0, 1.0, 0.05))


@dataclass
class AcceptanceRun:
    """One drafter at one block size and sampling temperature, over all domains."""

    label: str  # as named on the command line
    kind: str  # dspark | dflash | eagle3
    gamma: int
    native_gamma: int  # the checkpoint's own block size
    temperature: float
    rounds: RoundLog
    calibration: Calibration | None  # calibration.json, if any


def position_acceptance(accepted: np.ndarray, gamma: int) -> tuple[list[float], list[float]]:
    """Unconditional P(accepted >= k) and conditional P(accepted >= k | accepted >= k-1), k = 1..gamma."""
    reached = np.array([(accepted >= k).sum() for k in range(gamma + 1)], dtype=float)
    n = reached[0]
    unconditional = (reached[1:] / n).tolist() if n else [math.nan] * gamma
    with np.errstate(invalid="ignore", divide="ignore"):
        conditional = np.where(reached[:-1] > 0, reached[1:] / reached[:-1], np.nan).tolist()
    return unconditional, conditional


def threshold_sweep(
    conf: np.ndarray, accepted: np.ndarray, thresholds: tuple[float, ...] = THRESHOLDS
) -> list[dict]:
    """Per threshold x: verify positions up to (not including) the first c_k < x."""
    rows = []
    for x in thresholds:
        below = conf < x
        verified = np.where(below.any(axis=1), below.argmax(axis=1), conf.shape[1])
        kept = np.minimum(accepted, verified)
        rows.append(
            {
                "threshold": x,
                "acceptance_rate": float(kept.sum() / verified.sum()) if verified.sum() else math.nan,
                "tokens_per_round": float(1.0 + kept.mean()),
                "verified_per_round": float(verified.mean()),
            }
        )
    return rows


def summarize_domain(rounds: RoundLog, calibration: Calibration | None, temperature: float) -> dict:
    """The metrics of one domain's full-block rounds, sampled at `temperature`."""
    full = rounds.full_blocks()
    if len(full) == 0:
        raise ValueError("no full-block rounds recorded; raise max_tokens")
    gamma = full.gamma
    unconditional, conditional = position_acceptance(full.accepted, gamma)
    summary = {
        "rounds": len(full),
        "tau": float(1.0 + full.accepted.mean()),
        "acceptance_rate": float(full.accepted.mean() / gamma),
        "unconditional": unconditional,
        "conditional": conditional,
    }
    if full.has_confidences:
        temperatures, offsets = (
            calibration.for_temperature(temperature) if calibration is not None else (None, None)
        )
        summary["threshold_sweep"] = threshold_sweep(
            confidences(full.conf_logits, temperatures, offsets), full.accepted
        )
        if calibration is not None:
            reports = evaluate(full, temperatures, offsets=offsets)
            summary["ece_raw"] = [r.ece_before for r in reports]
            summary["ece_calibrated"] = [r.ece_after for r in reports]
            summary["auc"] = [r.auc_after for r in reports]
    return summary


def summarize_run(run: AcceptanceRun) -> dict:
    """Per-domain metrics and the macro average of tau over domains."""
    domains = list(dict.fromkeys(run.rounds.domain.tolist()))
    per_domain = {
        d: summarize_domain(run.rounds.select(run.rounds.domain == d), run.calibration, run.temperature)
        for d in domains
    }
    return {
        "drafter": run.label,
        "kind": run.kind,
        "gamma": run.gamma,
        "native_gamma": run.native_gamma,
        "temperature": run.temperature,
        "calibrated": run.calibration is not None,
        "macro_tau": float(np.mean([s["tau"] for s in per_domain.values()])),
        "domains": per_domain,
    }


def ratios(summaries: list[dict]) -> list[dict]:
    """Macro tau of the first DSpark drafter over the first DFlash / EAGLE-3 one, per gamma and temperature."""
    out = []
    keys = sorted({(s["gamma"], s["temperature"]) for s in summaries}, key=lambda k: (k[0], -k[1]))
    for gamma, temperature in keys:
        at = {}
        for s in summaries:
            if (s["gamma"], s["temperature"]) == (gamma, temperature):
                at.setdefault(s["kind"], s)
        if "dspark" not in at:
            continue
        for other in ("dflash", "eagle3"):
            if other in at:
                out.append(
                    {
                        "gamma": gamma,
                        "temperature": temperature,
                        "numerator": at["dspark"]["drafter"],
                        "denominator": at[other]["drafter"],
                        "ratio": at["dspark"]["macro_tau"] / at[other]["macro_tau"],
                    }
                )
    return out


def format_markdown(summaries: list[dict], meta: dict) -> str:
    """Tau table (drafter x gamma x temperature -> per-domain and macro tau), ratios, per-position acceptance."""
    domains = list(dict.fromkeys(d for s in summaries for d in s["domains"]))
    prompts = meta.get("prompts", "bench split")
    source = (
        f"{meta['num_prompts']} held-out bench prompts per domain"
        if prompts == "bench split"
        else f"the {meta['num_prompts']} prompts of `{prompts}`"
    )
    lines = [
        "# Acceptance benchmark",
        "",
        f"Target `{meta['target']}`, {source}, "
        f"max_tokens {meta['max_tokens']}, whole block verified every round (no scheduler). "
        "tau = 1 + accepted draft tokens per round (bonus included), full-block rounds only.",
        "",
        "| drafter | kind | gamma | temperature | " + " | ".join(domains) + " | macro |",
        "|---|---|---|---|" + "---|" * (len(domains) + 1),
    ]
    for s in summaries:
        taus = [f"{s['domains'][d]['tau']:.2f}" if d in s["domains"] else "-" for d in domains]
        gamma = f"{s['gamma']}" + (
            "" if s["gamma"] == s["native_gamma"] else f" (trained {s['native_gamma']})"
        )
        lines.append(
            f"| {s['drafter']} | {s['kind']} | {gamma} | {s['temperature']:g} | "
            + " | ".join(taus)
            + f" | {s['macro_tau']:.2f} |"
        )
    rs = ratios(summaries)
    if rs:
        lines += ["", "| gamma | temperature | macro tau ratio | value |", "|---|---|---|---|"]
        for r in rs:
            lines.append(
                f"| {r['gamma']} | {r['temperature']:g} | {r['numerator']} / {r['denominator']} | {r['ratio']:.3f} |"
            )
    lines += ["", "Conditional acceptance per position (P(k accepted | 1..k-1 accepted)):", ""]
    width = max(s["gamma"] for s in summaries)
    lines += [
        "| drafter | gamma | temperature | domain | "
        + " | ".join(str(k) for k in range(1, width + 1))
        + " |",
        "|---|---|---|---|" + "---|" * width,
    ]
    for s in summaries:
        for d, m in s["domains"].items():
            cells = [f"{v:.2f}" if not math.isnan(v) else "-" for v in m["conditional"]]
            cells += [""] * (width - len(cells))
            lines.append(
                f"| {s['drafter']} | {s['gamma']} | {s['temperature']:g} | {d} | " + " | ".join(cells) + " |"
            )
    calibrated = [s for s in summaries if s["calibrated"]]
    if calibrated:
        lines += ["", "ECE of the cumulative survival a_k on these prompts, raw -> calibrated:", ""]
        for s in calibrated:
            for d, m in s["domains"].items():
                pairs = ", ".join(
                    f"{a * 100:.1f}->{b * 100:.1f}%"
                    for a, b in zip(m["ece_raw"], m["ece_calibrated"], strict=True)
                )
                lines.append(f"- {s['drafter']} gamma {s['gamma']} T={s['temperature']:g} {d}: {pairs}")
    return "\n".join(lines) + "\n"


def run_acceptance(
    engine,
    drafters: dict[str, Path],
    prompts: dict[str, list[list[int]]],
    *,
    temperatures: list[float],
    gammas: list[int | None],
    max_tokens: int,
    seed: int = 0,
    max_num_seqs: int = 8,
    progress: Callable[[int], None] | None = None,
) -> list[AcceptanceRun]:
    """Every drafter x block size (None = its own) x temperature over the same prompts and seeds."""
    from dspark.calibration.collect import collect_rounds
    from dspark.drafters.config import DraftConfig

    runs = []
    for label, path in drafters.items():
        config = DraftConfig.load(path)
        calibration = Calibration.find(path, config.gamma)
        for gamma in gammas:
            for temperature in temperatures:
                rounds = collect_rounds(
                    engine,
                    path,
                    prompts,
                    temperature=temperature,
                    max_tokens=max_tokens,
                    gamma=gamma,
                    seed=seed,
                    max_num_seqs=max_num_seqs,
                    progress=progress,
                )
                runs.append(
                    AcceptanceRun(
                        label,
                        config.kind,
                        rounds.gamma,
                        config.gamma,
                        temperature,
                        rounds,
                        calibration,
                    )
                )
    return runs


def write_report(runs: list[AcceptanceRun], meta: dict, output_dir: str | Path) -> dict[str, Path]:
    """acceptance.json, acceptance.md, per_position.png, threshold_sweep.png (and the raw rounds)."""
    from dspark.bench.acceptance_plots import plot_per_position, plot_threshold_sweep

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    summaries = [summarize_run(r) for r in runs]
    for run in runs:
        run.rounds.save(out / "rounds" / f"{Path(run.label).name}-g{run.gamma}-t{run.temperature:g}.npz")
    files = {
        "json": out / "acceptance.json",
        "markdown": out / "acceptance.md",
        "per_position": plot_per_position(summaries, out / "per_position.png"),
        "threshold_sweep": plot_threshold_sweep(summaries, out / "threshold_sweep.png"),
    }
    payload = {"meta": meta, "runs": summaries, "ratios": ratios(summaries)}
    files["json"].write_text(json.dumps(_finite(payload), indent=2) + "\n")
    files["markdown"].write_text(format_markdown(summaries, meta))
    return files


def _finite(value):
    """NaN -> None so the JSON is standard."""
    if isinstance(value, float):
        return None if math.isnan(value) else value
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
