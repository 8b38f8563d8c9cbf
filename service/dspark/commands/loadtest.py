"""`dspark loadtest`: Locust SLA scenarios (exit code = verdict) and throughput-interactivity frontiers.

Traffic goes to loopback (http://127.0.0.1:8000) unless --host names another address; every run is
bounded by its scenario's duration and request cap.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from click.core import ParameterSource

DEFAULT_HOST = "http://127.0.0.1:8000"  # the same as dspark_loadtest.safety.DEFAULT_HOST


def _import_loadtest():
    try:
        import dspark_loadtest  # noqa: F401
    except ImportError:
        raise click.ClickException(
            "the load test is not installed: pip install 'dspark-serve[loadtest]'"
        ) from None


def _targets(ctx: click.Context, hosts: tuple[str, ...]) -> list[str]:
    from dspark_loadtest.safety import check_target

    user_given = ctx.get_parameter_source("hosts") is ParameterSource.COMMANDLINE
    try:
        return [check_target(h, user_given) for h in hosts]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--host") from None


def _workload_options(command):
    for option in reversed(
        [
            click.option(
                "--tiers-file",
                type=click.Path(exists=True, dir_okay=False, path_type=Path),
                default=None,
                help="Tier definitions (default: the packaged loadtest/tiers.yaml).",
            ),
            click.option(
                "--api",
                type=click.Choice(["chat", "completions", "mixed"]),
                default=None,
                help="Override the tier's API.",
            ),
            click.option("--mix", default=None, help="Override the domain mix, e.g. math=1,code=2,chat=1."),
            click.option(
                "--prompt-words", type=click.IntRange(min=0), default=None, help="Override the prompt length."
            ),
            click.option(
                "--max-tokens", type=click.IntRange(min=1), default=None, help="Override max_tokens."
            ),
            click.option("--model", default=None, help="Model name (default: asked from /v1/models)."),
            click.option("--api-prefix", default="/v1", show_default=True, help="/openai/v1 for KServe."),
            click.option(
                "--api-key", envvar="DSPARK_API_KEY", default=None, help="Bearer token (or DSPARK_API_KEY)."
            ),
            click.option(
                "--out",
                type=click.Path(file_okay=False, path_type=Path),
                default=Path("loadtest-results"),
                show_default=True,
                help="Directory for reports.",
            ),
        ]
    ):
        command = option(command)
    return command


def _resolve(tiers_file, tier_name, **overrides):
    from dspark_loadtest.run_state import resolve_tier
    from dspark_loadtest.tiers import DEFAULT_TIERS_FILE, load_tiers

    try:
        tiers = load_tiers(tiers_file or DEFAULT_TIERS_FILE)
        return tiers, resolve_tier(tiers, tier_name, **overrides)
    except (ValueError, KeyError) as e:
        raise click.ClickException(str(e)) from None


@click.group()
def loadtest() -> None:
    """Load-test a running server against SLA tiers (Locust)."""


@loadtest.command("run")
@click.option(
    "--host",
    "hosts",
    multiple=True,
    default=[DEFAULT_HOST],
    show_default=True,
    help="Server base URL; a non-loopback address only when given here.",
)
@click.option("--tier", "tier_name", default=None, help="Tier from the tier file (default: its first).")
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=None,
    help="Constant users instead of the tier's shape.",
)
@click.option(
    "--duration", type=click.FloatRange(min=1, max=3600), default=None, help="Seconds instead of the tier's."
)
@click.option(
    "--max-requests", type=click.IntRange(min=1), default=None, help="Request cap instead of the tier's."
)
@_workload_options
@click.option("--web", is_flag=True, help="Show Locust's web UI on 127.0.0.1 while the scenario runs.")
@click.option("--web-port", type=int, default=8089, show_default=True)
@click.pass_context
def run(
    ctx,
    hosts,
    tier_name,
    concurrency,
    duration,
    max_requests,
    tiers_file,
    api,
    mix,
    prompt_words,
    max_tokens,
    model,
    api_prefix,
    api_key,
    out,
    web,
    web_port,
) -> None:
    """Run one tier's scenario; print the SLA table; exit 0 on pass, 1 on a breach, 2 on a failed run."""
    _import_loadtest()
    from dspark_loadtest.runner import run_scenario

    if len(hosts) != 1:
        raise click.BadParameter("give one --host for a scenario run", param_hint="--host")
    (host,) = _targets(ctx, hosts)
    _, tier = _resolve(
        tiers_file,
        tier_name,
        concurrency=concurrency,
        seconds=duration,
        api=api,
        mix=mix,
        prompt_words=prompt_words,
        max_tokens=max_tokens,
        max_requests=max_requests,
    )
    options = {
        "tiers_file": tiers_file,
        "tier": tier.name,
        "concurrency": concurrency,
        "scenario_seconds": duration,
        "api": api,
        "mix": mix,
        "prompt_words": prompt_words,
        "max_tokens": max_tokens,
        "max_requests": max_requests,
        "model": model,
        "api_prefix": api_prefix,
        "api_key": api_key,
    }
    prefix = out / tier.name
    click.echo(
        f"tier {tier.name} against {host} for {tier.load.duration:g} s; reports under {out}/", err=True
    )
    result = run_scenario(
        host, prefix, tier.load.duration, options, web_port=web_port if web else None, echo=True
    )
    if result.report is None:
        click.echo(
            f"Error: the run measured nothing and wrote no report (locust exit {result.returncode})", err=True
        )
        sys.exit(2)
    sys.exit(result.returncode)


@loadtest.command("frontier")
@click.option(
    "--host",
    "hosts",
    multiple=True,
    default=[DEFAULT_HOST],
    show_default=True,
    help="Server base URL; repeat to compare servers on one figure.",
)
@click.option("--label", "labels", multiple=True, help="One label per --host (default: the host).")
@click.option("--concurrency", default="1,2,4,8", show_default=True, help="Concurrency levels to sweep.")
@click.option(
    "--duration",
    type=click.FloatRange(min=1, max=3600),
    default=15,
    show_default=True,
    help="Seconds per point.",
)
@click.option("--tier", "tier_name", default=None, help="Whose workload to send (default: the first tier).")
@_workload_options
@click.pass_context
def frontier(
    ctx,
    hosts,
    labels,
    concurrency,
    duration,
    tier_name,
    tiers_file,
    api,
    mix,
    prompt_words,
    max_tokens,
    model,
    api_prefix,
    api_key,
    out,
) -> None:
    """Sweep concurrency per server; write frontier.json and frontier.png with the tier anchors."""
    _import_loadtest()
    from dspark_loadtest.frontier import parse_concurrency, sweep, write_frontier

    targets = _targets(ctx, hosts)
    if labels and len(labels) != len(targets):
        raise click.BadParameter(f"{len(labels)} labels for {len(targets)} hosts", param_hint="--label")
    try:
        levels = parse_concurrency(concurrency)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--concurrency") from None
    tiers, tier = _resolve(
        tiers_file, tier_name, api=api, mix=mix, prompt_words=prompt_words, max_tokens=max_tokens
    )
    options = {
        "tiers_file": tiers_file,
        "tier": tier.name,
        "api": api,
        "mix": mix,
        "prompt_words": prompt_words,
        "max_tokens": max_tokens,
        "model": model,
        "api_prefix": api_prefix,
        "api_key": api_key,
    }
    series = []
    for host, label in zip(targets, labels or targets, strict=True):
        click.echo(f"{label}: concurrency {levels}, {duration:g} s each", err=True)
        try:
            series.append(sweep(host, label, levels, duration, out, options))
        except RuntimeError as e:
            raise click.ClickException(str(e)) from None
    meta = {
        "workload_tier": tier.name,
        "duration_s": duration,
        "concurrency": levels,
        "workload": tier.workload.model_dump(by_alias=True),
    }
    json_path, png_path = write_frontier(series, list(tiers.tiers), out, meta)
    for s in series:
        for p in s.points:
            click.echo(
                f"{s.label:>16}  c={p.concurrency:<4} aggregate {p.aggregate_tokens_per_s or 0:8.1f} tok/s  "
                f"per user p50 {p.tokens_per_s_per_user_p50 or 0:7.1f} tok/s  "
                f"TTFT p95 {p.ttft_p95_s or 0:.3f} s  {p.failures}/{p.requests} failed"
            )
    click.echo(f"saved {json_path} and {png_path}", err=True)


@loadtest.command("tiers")
@click.option("--tiers-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
def tiers_command(tiers_file) -> None:
    """List the tiers and their targets."""
    _import_loadtest()
    tiers, _ = _resolve(tiers_file, None)
    for t in tiers.tiers:
        p10 = f", p10 >= {t.tokens_per_second_per_user_p10:g}" if t.tokens_per_second_per_user_p10 else ""
        click.echo(
            f"{t.name:<20} tokens/s per user p50 >= {t.tokens_per_second_per_user:g}{p10}, "
            f"TTFT p95 <= {t.ttft_p95_seconds:g} s, {t.load.shape} load for {t.load.duration:g} s"
        )
