"""`dspark train CONFIG`: target features, drafter training, export; `dspark train data`: the corpus."""

from __future__ import annotations

import logging
from pathlib import Path

import click


class _TrainGroup(click.Group):
    """`dspark train CONFIG ...` runs the `run` subcommand, so the one-config form keeps working."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_TrainGroup)
def train() -> None:
    """Train drafters (`dspark train CONFIG`) and grow the self-distilled corpus (`dspark train data`)."""


@train.command("run")
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
@click.option(
    "--export-every",
    type=click.IntRange(min=1),
    default=None,
    help="Also export the drafter to out_dir/step-NNNNNN every N steps (learning-curve points).",
)
@click.option(
    "--features",
    type=click.Choice(["online", "cached"]),
    default=None,
    help="Override the config's features: the target's forward per batch, or stored feature shards.",
)
@click.option(
    "--warm-start",
    default=None,
    help="Override the config's warm_start: auto | shipped | none | a drafter checkpoint directory.",
)
@click.option(
    "--data-only",
    is_flag=True,
    help="Only build the data directory (prompts, samples, and the features when they are cached).",
)
@click.option(
    "--skip-bad-shards",
    is_flag=True,
    help="Leave out corpus shards that are truncated or corrupt (each is reported by file name).",
)
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def run(
    config: Path,
    device: str | None,
    max_steps: int | None,
    stop_after: int | None,
    export_to: Path | None,
    export_every: int | None,
    features: str | None,
    warm_start: str | None,
    data_only: bool,
    skip_bad_shards: bool,
    no_progress: bool,
) -> None:
    """Train a DSpark, DFlash or EAGLE-3 drafter as described by CONFIG (YAML or JSON).

    Resumable: rerunning the same config continues from the data directory and out_dir/state.pt;
    without a state.pt the run starts from `warm_start` (the shipped drafter of its kind by default).
    """
    from pydantic import ValidationError

    from dspark.training.config import TrainConfig
    from dspark.training.prompts import NoUsableData
    from dspark.training.shards import ShardError
    from dspark.training.sources import SourceUnavailable
    from dspark.validation import describe

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = TrainConfig.load(config)
        updates: dict = {}
        if device is not None:
            updates["device"] = device
        if features is not None:
            updates["features"] = features
        if warm_start is not None:
            updates["warm_start"] = warm_start
        if max_steps is not None:
            updates["optim"] = cfg.optim.model_copy(update={"max_steps": max_steps})
        cfg = TrainConfig.model_validate({**cfg.model_dump(), **updates})
    except ValidationError as exc:
        raise click.ClickException(f"{config}: {describe(exc)}") from exc
    except ValueError as exc:
        raise click.ClickException(f"{config}: {exc}") from exc
    try:
        if data_only:
            from dspark.engine.config import resolve_device, resolve_dtype
            from dspark.training.pipeline import collect_samples, prepare_data

            dev = resolve_device(cfg.device)
            args = (cfg, dev, resolve_dtype(cfg.dtype, dev))
            if cfg.features == "cached":
                shards = prepare_data(*args, progress=not no_progress, skip_bad_shards=skip_bad_shards)
                click.echo(f"data ready: {len(shards)} feature shards in {cfg.data_dir}")
            else:
                groups = collect_samples(*args, progress=not no_progress, skip_bad_shards=skip_bad_shards)
                click.echo(f"data ready: {sum(len(s) for _, s in groups)} samples (features computed online)")
            return
        from dspark.training.run import run_training

        out = run_training(
            cfg,
            progress=not no_progress,
            stop_after=stop_after,
            export_to=export_to,
            skip_bad_shards=skip_bad_shards,
            export_every=export_every,
        )
    except (NoUsableData, SourceUnavailable, ShardError, ValueError) as exc:
        # Missing corpora, unusable data and a data or state directory written by another config.
        raise click.ClickException(str(exc)) from exc
    if out is None:
        click.echo(f"stopped; state saved in {cfg.out_dir} (rerun to continue)")
    else:
        click.echo(f"drafter written to {out}")


@train.command("data")
@click.option(
    "--add-shards", type=click.IntRange(min=1), required=True, help="Generate this many new shards."
)
@click.option(
    "--corpus",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Corpus directory with its corpus.yaml [default: data/selfdistill/smollm2-135m].",
)
@click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda | cuda:N")
@click.option(
    "--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True
)
@click.option(
    "--batch", type=click.IntRange(min=1), default=256, show_default=True, help="Requests decoded at once."
)
@click.option(
    "--max-batch-tokens",
    type=click.IntRange(min=16),
    default=None,
    help="Token budget of one forward [default: 2 x batch].",
)
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("runs/selfdistill"),
    show_default=True,
    help="Where unfinished shards keep their finished responses (an interrupted run resumes from it) "
    "and the prompt order is cached (copy its prompt-order.jsonl.gz to a machine without the sources).",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="CPU threads of the forwards [default: torch's]. 1 on a CPU shared with other jobs: a "
    "2-thread team whose threads wait for each other's core measured 12x slower per step.",
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def data(
    add_shards: int,
    corpus: Path | None,
    device: str,
    dtype: str,
    batch: int,
    max_batch_tokens: int | None,
    work_dir: Path,
    threads: int | None,
    no_progress: bool,
) -> None:
    """Grow a self-distilled corpus by its next shards (the target's own responses, plain decoding)."""
    from pydantic import ValidationError

    from dspark.training.corpus import DEFAULT_CORPUS
    from dspark.training.corpus import add_shards as generate
    from dspark.training.prompts import NoUsableData
    from dspark.training.shards import ShardError
    from dspark.training.sources import SourceUnavailable
    from dspark.validation import describe

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    corpus = corpus or DEFAULT_CORPUS
    try:
        report = generate(
            corpus,
            add_shards,
            device=device,
            dtype=dtype,
            batch=batch,
            max_batch_tokens=max_batch_tokens,
            work_dir=work_dir,
            threads=threads,
            progress=not no_progress,
        )
    except ValidationError as exc:
        raise click.ClickException(f"{corpus}: {describe(exc)}") from exc
    except (NoUsableData, SourceUnavailable, ShardError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(
        f"{len(report.shards)} shards written to {corpus} ({report.new_tokens} new tokens in "
        f"{report.seconds:.0f} s, {report.tokens_per_s:.0f} tokens/s)"
    )
