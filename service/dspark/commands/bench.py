"""`dspark bench`: reproducible benchmarks that print one table and save JSON."""

from __future__ import annotations

import datetime
import platform
from pathlib import Path

import click

from dspark.commands.options import engine_options


@click.group()
def bench() -> None:
    """Benchmarks (run side by side in one process; report medians and ratios)."""


@bench.command()
@engine_options
@click.option(
    "--domains", default="code,chat,math", show_default=True, help="Comma-separated prompt domains."
)
@click.option("--num-prompts", type=int, default=4, show_default=True, help="Prompts per domain.")
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option(
    "--lookup", type=int, default=4, show_default=True, help="Draft length for n-gram / prompt lookup."
)
@click.option("--no-hf", is_flag=True, help="Skip the HF transformers generate() baselines.")
@click.option(
    "--output", type=click.Path(path_type=Path), default=Path("runs/bench-decode.json"), show_default=True
)
def decode(engine_config, domains, num_prompts, max_tokens, lookup, no_hf, output) -> None:
    """Tokens/s at batch 1: engine plain vs n-gram vs HF generate() (plain and prompt lookup)."""
    from tqdm import tqdm

    from dspark.bench.decode import format_table, run_decode_bench, summarize, write_report
    from dspark.bench.prompts import BUILTIN_PROMPTS

    names = [d.strip() for d in domains.split(",") if d.strip()]
    unknown = [d for d in names if d not in BUILTIN_PROMPTS]
    if unknown:
        raise click.BadParameter(f"unknown domain(s) {unknown}; known: {sorted(BUILTIN_PROMPTS)}")
    prompts = {d: BUILTIN_PROMPTS[d][:num_prompts] for d in names}
    with tqdm(total=sum(map(len, prompts.values())), desc="bench decode", unit="prompt") as bar:
        results = run_decode_bench(
            engine_config, prompts, max_tokens, lookup, include_hf=not no_hf, progress=bar.update
        )
    rows = summarize(results)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "config": engine_config.model_dump(),
        "max_tokens": max_tokens,
    }
    write_report(results, rows, meta, output)
    click.echo(format_table(rows))
    click.echo(f"saved {output}")
