"""`dspark train CONFIG`: self-distillation data, target features, drafter training, export."""

from __future__ import annotations

import logging
from pathlib import Path

import click


@click.command()
@click.argument("config", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--device", default=None, help="Override the config's device (auto | cpu | cuda | cuda:N).")
@click.option(
    "--max-steps", type=int, default=None, help="Override optim.max_steps (extend or shorten a run)."
)
@click.option(
    "--stop-after", type=int, default=None, help="Train this many steps now, then stop (resumable)."
)
@click.option(
    "--export-to",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Also copy the exported drafter here (e.g. the shipped-drafter directory).",
)
@click.option("--data-only", is_flag=True, help="Only build the data directory (prompts, samples, features).")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def train(
    config: Path,
    device: str | None,
    max_steps: int | None,
    stop_after: int | None,
    export_to: Path | None,
    data_only: bool,
    no_progress: bool,
) -> None:
    """Train a DSpark, DFlash or EAGLE-3 drafter as described by CONFIG (YAML or JSON).

    Resumable: rerunning the same config continues from the data directory and out_dir/state.pt.
    """
    from pydantic import ValidationError

    from dspark.training.config import TrainConfig
    from dspark.training.prompts import NoUsableData
    from dspark.training.sources import SourceUnavailable
    from dspark.validation import describe

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = TrainConfig.load(config)
        updates: dict = {}
        if device is not None:
            updates["device"] = device
        if max_steps is not None:
            updates["optim"] = cfg.optim.model_copy(update={"max_steps": max_steps})
        cfg = cfg.model_copy(update=updates)
    except ValidationError as exc:
        raise click.ClickException(f"{config}: {describe(exc)}") from exc
    except ValueError as exc:
        raise click.ClickException(f"{config}: {exc}") from exc
    try:
        if data_only:
            from dspark.engine.config import resolve_device, resolve_dtype
            from dspark.training.pipeline import prepare_data

            dev = resolve_device(cfg.device)
            shards = prepare_data(cfg, dev, resolve_dtype(cfg.dtype, dev), progress=not no_progress)
            click.echo(f"data ready: {len(shards)} feature shards in {cfg.data_dir}")
            return
        from dspark.training.run import run_training

        out = run_training(cfg, progress=not no_progress, stop_after=stop_after, export_to=export_to)
    except (NoUsableData, SourceUnavailable, ValueError) as exc:
        # Missing corpora, unusable data and a data or state directory written by another config.
        raise click.ClickException(str(exc)) from exc
    if out is None:
        click.echo(f"stopped; state saved in {cfg.out_dir} (rerun to continue)")
    else:
        click.echo(f"drafter written to {out}")
