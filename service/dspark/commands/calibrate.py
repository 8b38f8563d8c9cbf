"""`dspark calibrate`: Sequential Temperature Scaling of a drafter's confidences on held-out rounds."""

from __future__ import annotations

import datetime
from pathlib import Path

import click

from dspark.models.registry import DEFAULT_MODEL


@click.command()
@click.argument("drafter")
@click.option("--target", default=DEFAULT_MODEL, show_default=True, help="Model name or HF-format directory.")
@click.option("--domains", default="math,code,chat", show_default=True, help="Comma-separated eval domains.")
@click.option(
    "--num-prompts", type=int, default=24, show_default=True, help="Calibration-split prompts per domain."
)
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option(
    "--temperature", type=float, default=1.0, show_default=True, help="Sampling temperature of the rounds."
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
    "--check-fraction",
    type=float,
    default=0.25,
    show_default=True,
    help="Share of requests held back from the fit to report ECE on unseen prompts (0 = none).",
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
    check_fraction,
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
    from dspark.calibration.plots import plot_reliability
    from dspark.calibration.report import format_table, write_calibration_report
    from dspark.calibration.rounds import RoundLog
    from dspark.calibration.sts import evaluate, fit_sts
    from dspark.drafters.calibration import Calibration, drafter_id

    try:
        checkpoint = resolve_drafter_dir(drafter, target)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="DRAFTER") from e
    if not 0 <= check_fraction < 1:
        raise click.BadParameter("must lie in [0, 1)", param_hint="--check-fraction")
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

    fit_rounds, check_rounds = _split_by_request(rounds, check_fraction)
    try:
        temperatures, fit_report = fit_sts(fit_rounds, offsets=offsets)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    biases = [r.offset for r in fit_report] if offsets else None
    check_report = evaluate(check_rounds, temperatures, offsets=biases) if check_rounds is not None else None
    ident = drafter_id(checkpoint)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "checkpoint": str(checkpoint),
        "target": target,
        "rounds": len(rounds),
        "fit_rounds": len(fit_rounds),
        "check_rounds": len(check_rounds) if check_rounds is not None else 0,
        # How the rounds were recorded; unknown here when they come from a file.
        "temperature": None if rounds_path else temperature,
        "max_tokens": None if rounds_path else max_tokens,
        "num_prompts": None if rounds_path else num_prompts,
        "source": str(rounds_path) if rounds_path else "engine",
    }
    report = write_calibration_report(
        output_dir / "calibration-report.json", ident, fit_report, check_report, meta
    )
    plot = plot_reliability(
        check_rounds if check_rounds is not None else fit_rounds,
        temperatures,
        output_dir / "reliability.png",
        title=f"{checkpoint.name}: cumulative survival, {'held-back check' if check_rounds is not None else 'fit'} rounds",
        offsets=biases,
    )
    click.echo(f"fit on {len(fit_rounds)} rounds:")
    click.echo(format_table(fit_report))
    if check_report is not None:
        click.echo(f"check on {len(check_rounds)} held-back rounds:")
        click.echo(format_table(check_report))
    worst = [r.position for r in fit_report if r.ece_after > 0.02]
    if worst:
        click.echo(f"warning: ECE after calibration is above 2% at positions {worst}; record more rounds")
    if not no_write:
        Calibration(drafter_id=ident, temperatures=temperatures, offsets=biases).save(checkpoint)
        click.echo(f"wrote {checkpoint / 'calibration.json'}")
    click.echo(f"saved {report} and {plot}")


def _record(
    checkpoint, target, domains, num_prompts, max_tokens, temperature, max_num_seqs, dtype, device, seed
):
    from tqdm import tqdm

    from dspark.bench.datasets import EVAL_DOMAINS
    from dspark.calibration.collect import base_engine, collect_rounds, encode_eval_prompts
    from dspark.models.pull import ModelError

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


def _split_by_request(rounds, check_fraction: float):
    """Hold back the last `check_fraction` of each domain's requests (whole requests, so the check
    rounds come from prompts the fit never saw); None when that leaves either side empty."""
    import math

    import numpy as np

    if check_fraction == 0:
        return rounds, None
    check = np.zeros(len(rounds), dtype=bool)
    for domain in np.unique(rounds.domain):
        requests = list(dict.fromkeys(rounds.request[rounds.domain == domain].tolist()))
        held = requests[len(requests) - math.floor(check_fraction * len(requests)) :]
        check |= np.isin(rounds.request, held) & (rounds.domain == domain)
    if not check.any() or check.all():
        return rounds, None
    return rounds.select(~check), rounds.select(check)
