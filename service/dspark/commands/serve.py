"""`dspark serve`: the HTTP server (OpenAI-compatible, or KServe with --kserve) over Ray Serve."""

from __future__ import annotations

from pathlib import Path

import click
import yaml

from dspark.drafters.factory import DRAFTER_HELP
from dspark.engine.policy_spec import POLICY_HELP
from dspark.policies.factory import AUTO_POLICY_HELP
from dspark.serving.config import load_config


@click.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="YAML settings file (also DSPARK_CONFIG); flags and DSPARK_* variables override it.",
)
@click.option("--target", help="Model name or HF-format directory.  [default: smollm2-135m]")
@click.option("--drafter", help=f"{DRAFTER_HELP}  [default: auto]")
@click.option("--policy", help=f"Verify-length policy: {AUTO_POLICY_HELP} | {POLICY_HELP}  [default: auto]")
@click.option("--gamma", type=int, help="Draft block size.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]))
@click.option("--device", help="auto | cpu | cuda | cuda:N")
@click.option("--max-num-seqs", type=int, help="Concurrently decoded requests per replica.")
@click.option("--max-model-len", type=int, help="Prompt + output tokens per request.")
@click.option("--max-batch-tokens", type=int, help="Token budget of one forward.")
@click.option(
    "--prefix-caching/--no-prefix-caching",
    default=None,
    help="Reuse the KV of cached prompt prefixes.  [default: on]",
)
@click.option(
    "--compile/--no-compile",
    default=None,
    help="Run the target's forward as inductor graphs on the CPU.  [default: on for the CPU]",
)
@click.option(
    "--engine-in-thread/--engine-in-process",
    default=None,
    help="Step the engine on a thread of the replica, not in its own process.  [default: process]",
)
@click.option(
    "--engine-threads",
    type=int,
    help="Intra-op threads of every engine step.  [default: the replica's CPUs, less one in its own "
    "process; on 2 CPUs 1 for one request, 2 for a batch]",
)
@click.option(
    "--pin-engine-threads/--no-pin-engine-threads",
    default=None,
    help="Pin the engine's intra-op threads one per core (a CPU engine of the only replica).  [default: on]",
)
@click.option("--host", help="Address to bind.  [default: 127.0.0.1]")
@click.option("--port", type=int, help="HTTP port.  [default: 8000]")
@click.option(
    "--api-key", help="Require `Authorization: Bearer <key>` on inference routes (also DSPARK_API_KEY)."
)
@click.option("--served-model-name", help="Model id clients use.  [default: the target's name]")
@click.option("--max-queue", type=int, help="Requests that may wait beyond --max-num-seqs before 429.")
@click.option("--num-replicas", type=int, help="Engine replicas (each owns one engine).")
@click.option(
    "--kserve/--no-kserve", default=None, help="Serve through kserve.ModelServer (v2 + /openai/v1)."
)
@click.option(
    "--ingress",
    type=click.Choice(["auto", "direct", "proxy"]),
    help="What accepts HTTP: the one replica itself (direct) or Ray Serve's proxy, which routes "
    "between replicas.  [default: auto: direct for one fixed replica]",
)
@click.option("--print-config", is_flag=True, help="Print the effective configuration and exit.")
def serve(config_file: Path | None, print_config: bool, **flags) -> None:
    """Serve the target with DSpark speculative decoding over HTTP (OpenAI-compatible API)."""
    try:
        config = load_config(config_file, overrides=flags)
        effective = config.effective()
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    if print_config:
        click.echo(yaml.safe_dump(effective, sort_keys=False), nl=False)
        return
    from dspark.models.pull import ModelError
    from dspark.serving.launcher import serve_forever
    from dspark.serving.runtime import PortUnavailable

    try:
        serve_forever(config, announce=lambda msg: click.echo(msg, err=True))
    except (ModelError, PortUnavailable) as e:
        raise click.ClickException(str(e)) from e
