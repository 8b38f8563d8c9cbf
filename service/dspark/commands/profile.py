"""`dspark profile`: measure SPS(B), the engine's verification steps per second by batch size."""

from __future__ import annotations

from pathlib import Path

import click

from dspark.commands.options import build_engine, engine_options


@click.command()
@engine_options
@click.option(
    "--output", "-o", default=None, help="Profile JSON path, or - for stdout (default: the profile cache)."
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Also write a PNG of the curve.",
)
@click.option(
    "--context-len", type=int, default=256, show_default=True, help="Cached context per request while timing."
)
@click.option(
    "--repeats",
    type=int,
    default=3,
    show_default=True,
    help="Timed forwards per batch size, at least (and 0.25 s of them); the median counts.",
)
def profile(engine_config, output, plot_path, context_len, repeats) -> None:
    """Profile this engine on this hardware and write the SPS profile (exit non-zero on failure)."""
    from dspark.profiling.acquire import default_profile_path, engine_identity, profile_with_progress

    engine = build_engine(engine_config.model_copy(update={"policy": "none"}))
    result = profile_with_progress(engine, context_len=context_len, repeats=repeats)
    text = result.model_dump_json(indent=2)
    if output == "-":
        click.echo(text)
    else:
        path = Path(output) if output else default_profile_path(*engine_identity(engine))
        result.save(path)
        click.echo(
            f"saved {path} ({len(result.points)} points, SPS(1) = {result.sps(1):.1f}/s, "
            f"SPS({result.points[-1].batch_tokens}) = {result.points[-1].steps_per_second:.1f}/s)",
            err=True,
        )
    if plot_path:
        from dspark.profiling.plots import plot_sps_profile

        plot_sps_profile(result, plot_path)
        click.echo(f"saved {plot_path}", err=True)
