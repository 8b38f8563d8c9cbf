"""`dspark generate`: prompt in, text out, with speculation statistics."""

from __future__ import annotations

import time

import click

from dspark.commands.options import build_engine, engine_options
from dspark.engine.prompt import encode_prompt


@click.command()
@click.argument("prompts", nargs=-1)
@engine_options
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--raw", is_flag=True, help="Send the prompt as is instead of through the chat template.")
@click.option("--system", default=None, help="System message for the chat template.")
def generate(prompts, engine_config, max_tokens, temperature, top_p, top_k, seed, raw, system) -> None:
    """Generate completions for PROMPTS (all decoded together in one batch)."""
    from pydantic import ValidationError

    from dspark.engine.sampling_params import SamplingParams
    from dspark.validation import describe

    if not prompts:
        raise click.UsageError("give at least one prompt")
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
        )
    except ValidationError as e:
        raise click.BadParameter(describe(e)) from e
    engine = build_engine(engine_config)
    token_ids = [encode_prompt(engine.tokenizer, p, raw=raw, system=system) for p in prompts]
    start = time.perf_counter()
    try:
        results = engine.generate(token_ids, params)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    elapsed = time.perf_counter() - start
    for prompt, result in zip(prompts, results, strict=True):
        s = result.stats
        click.echo(click.style(f"> {prompt}", bold=True))
        click.echo(result.text)
        click.echo(
            click.style(
                f"[{len(result.token_ids)} tokens, {s.rounds} rounds, tau {s.tau:.2f}, "
                f"{len(result.token_ids) / max(s.finish_time - s.arrival_time, 1e-9):.1f} tok/s, "
                f"finish: {result.finish_reason}]",
                dim=True,
            )
        )
    total = sum(len(r.token_ids) for r in results)
    click.echo(
        click.style(
            f"{total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tok/s) "
            f"with drafter {engine.drafter.name}, policy {engine.policy.name}, {engine.dtype}",
            dim=True,
        )
    )
