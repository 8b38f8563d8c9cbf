"""`dspark serve`: the HTTP server (OpenAI-compatible, or KServe with --kserve) over Ray Serve."""

from __future__ import annotations

from pathlib import Path

import click
import yaml

from dspark.commands.vllm_compat import VllmServeCommand, speculative_flags
from dspark.drafters.factory import DRAFTER_HELP
from dspark.engine.policy_spec import POLICY_HELP
from dspark.policies.factory import AUTO_POLICY_HELP
from dspark.serving.config import load_config


@click.command(cls=VllmServeCommand)
@click.argument("model", required=False)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="YAML settings file (also DSPARK_CONFIG); flags and DSPARK_* variables override it.",
)
@click.option(
    "--target",
    "--model",
    "target",
    help="Model name, HF-format directory or hub id org/name[@revision] (or the MODEL argument).  "
    "[default: smollm2-135m]",
)
@click.option("--revision", help="Hub revision (branch, tag or commit) of a hub-id target.")
@click.option("--tokenizer", help="Tokenizer directory or hub id.  [default: the target's]")
@click.option(
    "--chat-template", help="Chat template: a file, or the Jinja text itself.  [default: the tokenizer's]"
)
@click.option(
    "--generation-config",
    help="Sampling defaults for fields a request leaves out: auto (the target's generation_config.json), "
    "vllm (none), or a directory holding one.  [default: auto]",
)
@click.option("--seed", type=int, help="Seed the engine's global RNGs at start-up.")
@click.option("--drafter", help=f"{DRAFTER_HELP}  [default: auto]")
@click.option(
    "--speculative-config",
    help='vLLM\'s JSON: {"method": "dspark"|"dflash"|"eagle3"|"ngram", "model": drafter dir or hub id, '
    '"num_speculative_tokens": N}; instead of --drafter (and --gamma).',
)
@click.option("--policy", help=f"Verify-length policy: {AUTO_POLICY_HELP} | {POLICY_HELP}  [default: auto]")
@click.option("--gamma", type=int, help="Draft block size.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]))
@click.option("--device", help="auto | cpu | cuda | cuda:N")
@click.option("--max-num-seqs", type=int, help="Concurrently decoded requests per replica.")
@click.option("--max-model-len", type=int, help="Prompt + output tokens per request.")
@click.option(
    "--max-batch-tokens",
    "--max-num-batched-tokens",
    "max_batch_tokens",
    type=int,
    help="Token budget of one forward.",
)
@click.option(
    "--prefix-caching/--no-prefix-caching",
    "--enable-prefix-caching/--no-enable-prefix-caching",
    "prefix_caching",
    default=None,
    help="Reuse the KV of cached prompt prefixes.  [default: on]",
)
@click.option(
    "--compile/--no-compile",
    default=None,
    help="Run the target's forward as inductor graphs on the CPU.  [default: on for the CPU]",
)
@click.option(
    "--cuda-graphs/--no-cuda-graphs",
    default=None,
    help="Replay decode and verification steps as CUDA graphs.  [default: on for CUDA]",
)
@click.option("--enforce-eager", is_flag=True, help="vLLM's spelling of --no-compile --no-cuda-graphs.")
@click.option(
    "--build-in-background/--build-before-serving",
    default=None,
    help="Serve eagerly at once while the compiled forward and the CPU attention kernel build, or "
    "build them (and a full SPS profile) before the first request.  [default: in the background]",
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
@click.option(
    "--served-model-name",
    multiple=True,
    help="Model id clients use; several (repeated, or vLLM's `--served-model-name a b`) are all "
    "accepted and listed, the first names responses.  [default: the target's name]",
)
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
@click.option(
    "--address",
    help="Deploy onto the running Ray cluster at this address (auto, host:port, ray://host:10001) "
    "instead of starting Ray here; on exit the application is deleted and the cluster keeps running.  "
    "[default: $RAY_ADDRESS, else none]",
)
@click.option(
    "--router",
    type=click.Choice(["prefix", "round-robin", "pow2"]),
    help="How requests are spread over engine replicas, behind an ingress deployment: to the replica "
    "likely to hold the prompt's prefix (prefix), in turn, or Ray's power of two choices.  "
    "[default: prefix with several replicas; none for one]",
)
@click.option("--print-config", is_flag=True, help="Print the effective configuration and exit.")
def serve(
    config_file: Path | None,
    print_config: bool,
    model: str | None,
    speculative_config: str | None,
    enforce_eager: bool,
    **flags,
) -> None:
    """Serve MODEL (or --target) with DSpark speculative decoding over HTTP (OpenAI-compatible API)."""
    if model is not None:
        if flags["target"] not in (None, model):
            raise click.UsageError(f"MODEL {model!r} and --target {flags['target']!r} disagree; give one")
        flags["target"] = model
    flags.update(speculative_flags(speculative_config, flags["drafter"], flags["gamma"]))
    if enforce_eager:
        if flags["compile"] or flags["cuda_graphs"]:
            raise click.UsageError("--enforce-eager contradicts --compile / --cuda-graphs")
        flags.update(compile=False, cuda_graphs=False)
    flags["served_model_name"] = list(flags["served_model_name"]) or None
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
