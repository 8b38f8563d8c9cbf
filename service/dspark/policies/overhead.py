"""Median `schedule()` time of every verify policy: `python -m dspark.policies.overhead`.

Compare the figures with the engine's step time; the scheduler runs once per step.
"""

from __future__ import annotations

import statistics
import time

import click
import torch

from dspark.policies.factory import build_policy
from dspark.profiling.synthetic import synthetic_profile

POLICIES = ("none", "static:4", "full", "threshold:0.5", "dspark", "dspark-async")


def median_schedule_us(spec: str, requests: int, gamma: int, repeats: int, seed: int = 0) -> float:
    gen = torch.Generator().manual_seed(seed)
    policy = build_policy(spec, sps=synthetic_profile(max_batch_tokens=requests * (gamma + 1)))
    # Calibrated-looking confidences: mostly high, some low, as a trained head gives.
    confs = [torch.rand(requests, gamma, generator=gen).pow(0.3) for _ in range(8)]
    for c in confs:  # warm-up (and fills the async policy's history)
        policy.schedule(c, gamma, requests)
    times = []
    for i in range(repeats):
        c = confs[i % len(confs)]
        start = time.perf_counter()
        policy.schedule(c, gamma, requests)
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
    """Print the median schedule() time of each policy for R requests x gamma positions."""
    torch.set_num_threads(threads)
    click.echo(
        f"schedule() median over {repeats} calls, R={requests}, gamma={gamma}, CPU, {threads} thread(s)"
    )
    click.echo(f"{'policy':<16}{'median us':>10}")
    for spec in POLICIES:
        click.echo(f"{spec:<16}{median_schedule_us(spec, requests, gamma, repeats):>10.1f}")


if __name__ == "__main__":
    main()
