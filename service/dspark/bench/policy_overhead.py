"""Median per-step decision time of every verify policy: `python -m dspark.bench.policy_overhead`.

Times `max_length()` (the DSpark policies' drafting gate) plus `verify_lengths()`, which the engine
calls once per step; compare the figures with the engine's step time.
"""

from __future__ import annotations

import statistics
import time

import click
import torch

from dspark.engine.outputs import StepStats
from dspark.engine.policy_spec import PolicyName
from dspark.policies.factory import build_policy
from dspark.profiling.synthetic import synthetic_profile

POLICIES = tuple(
    {PolicyName.STATIC: f"{PolicyName.STATIC}:4", PolicyName.THRESHOLD: f"{PolicyName.THRESHOLD}:0.5"}.get(
        n, n
    )
    for n in PolicyName
)


def median_schedule_us(spec: str, requests: int, gamma: int, repeats: int, seed: int = 0) -> float:
    gen = torch.Generator().manual_seed(seed)
    profile = synthetic_profile(max_batch_tokens=requests * (gamma + 1))
    policy = build_policy(spec, sps=profile)
    # Calibrated-looking confidences: mostly high, some low, as a trained head gives.
    confs = [torch.rand(requests, gamma, generator=gen).pow(0.3) for _ in range(8)]
    for c in confs:  # warm-up: fills the async policy's history and the gate's pool and costs
        policy.max_length(gamma, requests)
        policy.verify_lengths(c, gamma, requests)
        # Cheap drafting, so the gate evaluates and drafts every step: the costlier path.
        for drafted in (True, False):
            forward_s = 1 / profile.sps(requests)
            policy.observe_step(
                StepStats(
                    verify_batch_tokens=requests,
                    verify_budgets=[0] * requests,
                    drafted=drafted,
                    draft_time_s=1e-4 * drafted,
                    forward_time_s=forward_s,
                    step_time_s=forward_s + 1e-3 + 1e-4 * drafted,
                )
            )
    times = []
    for i in range(repeats):
        c = confs[i % len(confs)]
        start = time.perf_counter()
        if policy.max_length(gamma, requests):
            policy.verify_lengths(c, gamma, requests)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


@click.command()
@click.option("--requests", "-R", default=64, show_default=True, help="Requests in the batch.")
@click.option("--gamma", "-g", default=15, show_default=True, help="Draft block length.")
@click.option("--repeats", default=500, show_default=True)
@click.option(
    "--threads", default=1, show_default=True, help="torch CPU threads (the engine's scheduler runs on one)."
)
def main(requests: int, gamma: int, repeats: int, threads: int) -> None:
    """Print the median max_length() + verify_lengths() time of each policy for R requests x gamma positions."""
    torch.set_num_threads(threads)
    click.echo(
        f"max_length() + verify_lengths() median over {repeats} calls, R={requests}, gamma={gamma}, CPU, {threads} thread(s)"
    )
    click.echo(f"{'policy':<16}{'median us':>10}")
    for spec in POLICIES:
        click.echo(f"{spec:<16}{median_schedule_us(spec, requests, gamma, repeats):>10.1f}")


if __name__ == "__main__":
    main()
