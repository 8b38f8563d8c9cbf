"""`dspark calibrate`: Sequential Temperature Scaling of a drafter's confidences on held-out rounds."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from dspark.models.registry import DEFAULT_MODEL

if TYPE_CHECKING:
    from dspark.calibration.rounds import RoundLog


@click.command()
@click.argument("drafter")
@click.option("--target", default=DEFAULT_MODEL, show_default=True, help="Model name or HF-format directory.")
@click.option("--domains", default="math,code,chat", show_default=True, help="Comma-separated eval domains.")
@click.option(
    "--num-prompts", type=int, default=24, show_default=True, help="Calibration-split prompts per domain."
)
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option(
    "--temperature",
    type=float,
    default=1.0,
    show_default=True,
    help="Sampling temperature of the rounds (also with --rounds). 0 fits the map for greedy "
    "requests, anything else the map for sampled ones; calibration.json keeps the other map.",
)
@click.option("--max-num-seqs", type=int, default=16, show_default=True, help="Requests decoded together.")
@click.option(
    "--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True
)
@click.option("--device", default="auto", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--rounds",
    "rounds_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Fit on previously recorded rounds (rounds.npz) instead of running the engine.",
)
@click.option(
    "--folds",
    type=click.IntRange(min=0),
    default=4,
    show_default=True,
    help="Report held-out ECE by cross-validation over requests: each fold's rounds are scored by "
    "a map fitted on the other folds (0: none). The written map is fitted on all rounds.",
)
@click.option(
    "--offsets/--no-offsets",
    default=True,
    show_default=True,
    help="Also fit a logit offset per position, c_k = sigmoid(z_k / T_k + b_k); it stays 0 where "
    "the temperature alone is as good (--no-offsets: temperatures only, the paper's STS).",
)
@click.option("--output-dir", type=click.Path(path_type=Path), help="Default: runs/calibration/<drafter>.")
@click.option("--no-write", is_flag=True, help="Do not write calibration.json beside the drafter.")
def calibrate(
    drafter,
    target,
    domains,
    num_prompts,
    max_tokens,
    temperature,
    max_num_seqs,
    dtype,
    device,
    seed,
    rounds_path,
    folds,
    offsets,
    output_dir,
    no_write,
) -> None:
    """Fit per-position confidence temperatures for DRAFTER (a checkpoint directory or a shipped name).

    Records rounds on the calibration split of the eval prompts (disjoint from `bench acceptance`),
    fits T_1..T_gamma (and offsets b_k) left to right, writes calibration.json beside the checkpoint (the engine applies
    it when it loads the drafter), a report (ECE before/after, AUC per position) and reliability.png.
    """
    from dspark.calibration.collect import resolve_drafter_dir
    from dspark.calibration.rounds import RoundLog
    from dspark.drafters.calibration import drafter_id

    try:
        checkpoint = resolve_drafter_dir(drafter, target)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="DRAFTER") from e
    output_dir = output_dir or Path("runs/calibration") / checkpoint.name
    if rounds_path is not None:
        rounds = RoundLog.load(rounds_path)
    else:
        rounds = _record(
            checkpoint,
            target,
            domains,
            num_prompts,
            max_tokens,
            temperature,
            max_num_seqs,
            dtype,
            device,
            seed,
        )
        rounds.save(output_dir / "rounds.npz")
    if not rounds.has_confidences:
        raise click.ClickException(f"{checkpoint} has no confidence head: nothing to calibrate")

    fit = _fit(rounds, folds, offsets)
    ident = drafter_id(checkpoint)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "checkpoint": str(checkpoint),
        "target": target,
        "rounds": len(rounds),
        "check": f"{folds}-fold cross-validation over requests (out-of-fold a_k)"
        if fit.held_out is not None
        else None,
        "temperature": temperature,  # recorded at, or declared for --rounds: which map this is
        # How the rounds were recorded; unknown here when they come from a file.
        "max_tokens": None if rounds_path else max_tokens,
        "num_prompts": None if rounds_path else num_prompts,
        "source": str(rounds_path) if rounds_path else "engine",
    }
    saved = _write_report(rounds, fit, checkpoint, ident, meta, output_dir)
    _echo_fit(rounds, fit, folds)
    if not no_write:
        _merged(checkpoint, ident, temperature == 0, fit.temperatures, fit.offsets).save(checkpoint)
        click.echo(
            f"wrote the {'greedy' if temperature == 0 else 'sampled'} map to {checkpoint / 'calibration.json'}"
        )
    click.echo(f"saved {saved[0]} and {saved[1]}")


@dataclass
class _Fit:
    """The map fitted on all rounds, its report, and the out-of-fold check when there is one."""

    temperatures: list[float]
    offsets: list[float] | None
    fit_report: list
    held_out: Any  # out-of-fold calibrated a_k, or None
    check_report: list | None


def _fit(rounds: RoundLog, folds: int, offsets: bool) -> _Fit:
    from dspark.calibration.sts import evaluate, fit_sts, out_of_fold

    try:
        temperatures, fit_report = fit_sts(rounds, offsets=offsets)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    try:
        held_out = out_of_fold(rounds, folds, offsets=offsets)
    except ValueError as e:  # a fold's complement too small to fit every position
        held_out = None
        click.echo(f"warning: no held-out estimate ({e}); record more rounds or lower --folds")
    biases = [r.offset for r in fit_report] if offsets else None
    check_report = (
        None if held_out is None else evaluate(rounds, temperatures, offsets=biases, calibrated=held_out)
    )
    return _Fit(temperatures, biases, fit_report, held_out, check_report)


def _write_report(
    rounds: RoundLog, fit: _Fit, checkpoint: Path, ident: str, meta: dict, output_dir: Path
) -> tuple[Path, Path]:
    """calibration-report.json and reliability.png under `output_dir`."""
    from dspark.calibration.plots import plot_reliability
    from dspark.calibration.report import write_calibration_report

    report = write_calibration_report(
        output_dir / "calibration-report.json", ident, fit.fit_report, fit.check_report, meta
    )
    plot = plot_reliability(
        rounds,
        fit.temperatures,
        output_dir / "reliability.png",
        title=f"{checkpoint.name}: cumulative survival, {'out-of-fold' if fit.held_out is not None else 'fit'} a_k",
        offsets=fit.offsets,
        calibrated=fit.held_out,
    )
    return report, plot


def _echo_fit(rounds: RoundLog, fit: _Fit, folds: int) -> None:
    from dspark.calibration.report import format_table

    click.echo(f"fit on {len(rounds)} rounds:")
    click.echo(format_table(fit.fit_report))
    if fit.check_report is not None:
        click.echo(f"held out ({folds}-fold cross-validation over requests):")
        click.echo(format_table(fit.check_report))
    worst = [r.position for r in fit.check_report or fit.fit_report if r.ece_after > 0.02]
    if worst:
        click.echo(f"warning: ECE after calibration is above 2% at positions {worst}; record more rounds")


def _record(
    checkpoint, target, domains, num_prompts, max_tokens, temperature, max_num_seqs, dtype, device, seed
):
    from tqdm import tqdm

    from dspark.calibration.collect import base_engine, collect_rounds, encode_eval_prompts
    from dspark.models.pull import ModelError
    from dspark.prompts.eval_sets import EVAL_DOMAINS

    names = [d.strip() for d in domains.split(",") if d.strip()]
    unknown = [d for d in names if d not in EVAL_DOMAINS]
    if unknown:
        raise click.BadParameter(
            f"unknown domain(s) {unknown}; known: {list(EVAL_DOMAINS)}", param_hint="--domains"
        )
    try:
        engine = base_engine(target, device, dtype)
        prompts = encode_eval_prompts(engine.tokenizer, names, num_prompts, "calibration")
        with tqdm(total=sum(map(len, prompts.values())), desc="calibration rounds", unit="prompt") as bar:
            return collect_rounds(
                engine,
                checkpoint,
                prompts,
                temperature=temperature,
                max_tokens=max_tokens,
                seed=seed,
                max_num_seqs=max_num_seqs,
                progress=bar.update,
            )
    except (ModelError, ValueError) as e:
        raise click.ClickException(str(e)) from e


def _merged(checkpoint, ident: str, greedy: bool, temperatures: list[float], offsets: list[float] | None):
    """This fit's map in place of the same kind's in the drafter's calibration.json, the other kind
    kept (a file for another drafter is replaced whole; a greedy map alone leaves sampled rows raw)."""
    from dspark.drafters.calibration import Calibration

    try:
        existing = Calibration.find(checkpoint, len(temperatures))
    except ValueError:
        existing = None
    if greedy:
        base = existing or Calibration(drafter_id=ident, temperatures=[1.0] * len(temperatures))
        return base.model_copy(update={"greedy_temperatures": temperatures, "greedy_offsets": offsets})
    update = {"drafter_id": ident, "temperatures": temperatures, "offsets": offsets}
    return existing.model_copy(update=update) if existing else Calibration(**update)
