"""Engine-selection flags shared by every command that runs the engine."""

from __future__ import annotations

import functools
from collections.abc import Callable

import click
from pydantic import ValidationError

from dspark.drafters.factory import DRAFTER_HELP
from dspark.engine.config import SELECTION_FIELDS, EngineConfig
from dspark.engine.policy_spec import POLICY_HELP
from dspark.policies.factory import AUTO_POLICY_HELP
from dspark.validation import describe

_DEFAULTS = EngineConfig()


def engine_options(command: Callable) -> Callable:
    """Add --target/--drafter/--policy/--dtype/--device and sizing flags; pass `engine_config`."""
    options = [
        click.option(
            "--target", default=_DEFAULTS.target, show_default=True, help="Model name or HF-format directory."
        ),
        click.option("--drafter", default=_DEFAULTS.drafter, show_default=True, help=DRAFTER_HELP),
        click.option(
            "--policy",
            default=_DEFAULTS.policy,
            show_default=True,
            help=f"Verify-length policy: {AUTO_POLICY_HELP} | {POLICY_HELP}",
        ),
        click.option(
            "--gamma", type=int, default=_DEFAULTS.gamma, show_default=True, help="Draft block size."
        ),
        click.option(
            "--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True
        ),
        click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda | cuda:N"),
        click.option("--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs, show_default=True),
        click.option("--max-model-len", type=int, default=_DEFAULTS.max_model_len, show_default=True),
        click.option("--max-batch-tokens", type=int, default=_DEFAULTS.max_batch_tokens, show_default=True),
        click.option(
            "--prefix-caching/--no-prefix-caching",
            default=_DEFAULTS.prefix_caching,
            show_default=True,
            help="Reuse the KV of cached prompt prefixes.",
        ),
        click.option(
            "--prefix-cache-gib",
            type=float,
            default=_DEFAULTS.prefix_cache_gib,
            show_default=True,
            help="Memory beside the KV slots that keeps finished requests' cached prefixes (LRU).",
        ),
        click.option(
            "--compile/--no-compile",
            default=None,
            help="Run the target's forward as inductor graphs on the CPU [default: on for the CPU "
            "unless DSPARK_COMPILE=0; about a minute at the first start, seconds once cached].",
        ),
        click.option(
            "--cuda-graphs/--no-cuda-graphs",
            default=None,
            help="Replay decode and verification steps as CUDA graphs per batch bucket "
            "[default: on for CUDA, off elsewhere].",
        ),
    ]

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        values = {f: kwargs.pop(f) for f in (*SELECTION_FIELDS, "compile", "cuda_graphs")}
        try:
            kwargs["engine_config"] = EngineConfig(**values)
        except ValidationError as e:
            raise click.BadParameter(describe(e)) from e
        return command(*args, **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def build_engine(config: EngineConfig):
    """Build an engine, turning configuration and model errors into clean CLI errors."""
    from dspark.builder import engine_from_config
    from dspark.models.pull import ModelError

    try:
        return engine_from_config(config)
    except (ModelError, ValueError) as e:
        raise click.ClickException(str(e)) from e
