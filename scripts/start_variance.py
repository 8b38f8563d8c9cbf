"""How much one server's speed depends on its start: N starts of each configuration, each measured
at 1 and 16 users with the same closed-loop HTTP client, once its compiled path is on.

Each level is measured `--repeats` times within a start (twins), so the spread between starts can
be read against the spread inside one start. Beside each figure it records what the drafting
policy did in that window, from the server's own counters: draft tokens verified and accepted per
generated token, and the decode steps the drafting gate ran without a drafter.

Before each window it times fixed work on the client's side (`machine_speed`: the same matrix
products on two threads for three seconds), so the machine's own drift between windows is printed
beside the servers'.

Prints every start's figures and the thread plan it chose, then per configuration and level the
slowest start over the fastest (each start's mean of its twins) and the widest twin spread, and the
slowest window of the fixed work over its fastest.

    python scripts/start_variance.py --starts 5
    python scripts/start_variance.py --starts 5 --config plain="--drafter none --policy none" --config defaults=""
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from dspark.bench.http_load import run_level, wait_until_serving
from dspark.bench.peer import bench_prompts, free_port
from dspark_loadtest.server_metrics import Snapshot, delta, scrape, server_view

COMPILED = "compiled the target's forward"
PLAN = re.compile(r"one request steps on (\d+) intra-op threads[^\n]*")
UNDRAFTED = ("dspark_undrafted_steps_total", ())


def read_metrics(base: str) -> Snapshot:
    snapshot = scrape(base)
    if snapshot is None:
        raise RuntimeError(f"cannot read {base}/metrics")
    return snapshot


def policy_share(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """What the policy did between two scrapes: draft tokens verified and accepted per generated
    token, and the decode steps the drafting gate ran without a drafter."""
    view = server_view(before, after)
    tokens = max(view.generation_tokens, 1.0)
    return {
        "draft_per_token": view.spec_decode_draft_tokens / tokens,
        "accepted_per_token": view.spec_decode_accepted_tokens / tokens,
        "undrafted_steps": delta(before, after).get(UNDRAFTED, 0.0),
    }


def machine_speed(seconds: float = 3.0) -> float:
    """512 x 512 fp32 matrix products per second on two threads: how fast the machine runs now."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    started, done = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        a @ b
        done += 1
    torch.set_num_threads(threads)
    return done / (time.perf_counter() - started)


def start(flags: str, port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-c", "from dspark.cli import main; main()", "serve", "--port", str(port)]
    with log.open("w") as out:
        return subprocess.Popen(
            command + shlex.split(flags), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def wait_for_line(log: Path, text: str, timeout_s: float, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return
        if process.poll() is not None:
            raise RuntimeError(f"the server exited; see {log}")
        time.sleep(1.0)
    raise TimeoutError(f"no {text!r} in {log} within {timeout_s:.0f} s")


def measure(flags: str, log: Path, args: argparse.Namespace) -> dict:
    """One start: serve, wait for the compiled path (unless --no-compile), warm up, then each level."""
    port = free_port()
    process = start(flags, port, log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(base, 900, alive=lambda: process.poll() is None)
        if "--no-compile" not in flags and "--enforce-eager" not in flags:
            wait_for_line(log, COMPILED, 900, process)
        prompts = bench_prompts()
        run_level(base, "smollm2-135m", prompts, 2, 2, 16)  # warm-up: first-call allocations
        levels: dict[int, list[tuple[float, dict[str, float]]]] = {}
        for users in args.users:
            for _ in range(args.repeats):
                machine = machine_speed()
                before = read_metrics(base)
                result = run_level(
                    base, "smollm2-135m", prompts, users, max(args.rounds * users, 8), args.max_tokens
                )
                share = {**policy_share(before, read_metrics(base)), "machine": machine}
                levels.setdefault(users, []).append((result.aggregate_tokens_per_s, share))
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=120)
    plan = PLAN.search(log.read_text(errors="replace"))
    return {"levels": levels, "plan": plan.group(0) if plan else "no plan line"}


def describe(twins: list[tuple[float, dict[str, float]]]) -> str:
    speeds = " / ".join(f"{tps:.1f}" for tps, _ in twins)
    drafted = " / ".join(f"{s['draft_per_token']:.2f}" for _, s in twins)
    accepted = " / ".join(f"{s['accepted_per_token']:.2f}" for _, s in twins)
    undrafted = " / ".join(f"{s['undrafted_steps']:.0f}" for _, s in twins)
    machine = " / ".join(f"{s['machine']:.0f}" for _, s in twins)
    return (
        f"{speeds} (draft/token {drafted}, accepted/token {accepted}, undrafted steps {undrafted}, "
        f"fixed work/s before {machine})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument(
        "--config",
        action="append",
        metavar="NAME=FLAGS",
        help='`dspark serve` flags per configuration (default: plain="--drafter none --policy none" and defaults="")',
    )
    parser.add_argument("--users", type=lambda s: [int(u) for u in s.split(",")], default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="measurements of each level per start")
    parser.add_argument(
        "--rounds", type=int, default=4, help="requests per level, in multiples of the user count"
    )
    parser.add_argument("--log-dir", type=Path, default=Path("runs/start-variance"))
    args = parser.parse_args()
    configs = dict(
        c.split("=", 1) for c in args.config or ["plain=--drafter none --policy none", "defaults="]
    )
    args.log_dir.mkdir(parents=True, exist_ok=True)

    results: dict[str, list[dict]] = {name: [] for name in configs}
    print("| config | start | " + " | ".join(f"{u} users tok/s" for u in args.users) + " | plan |")
    print("|---|---|" + "---|" * len(args.users) + "---|")
    for i in range(args.starts):  # alternate configurations so drift falls on both alike
        for name, flags in configs.items():
            r = measure(flags, args.log_dir / f"{name}-{i + 1}.log", args)
            results[name].append(r)
            cells = " | ".join(describe(r["levels"][u]) for u in args.users)
            print(f"| {name} | {i + 1} | {cells} | {r['plan']} |", flush=True)
    for name, runs in results.items():
        for u in args.users:
            twins = [[tps for tps, _ in r["levels"][u]] for r in runs]
            means = [sum(t) / len(t) for t in twins]
            inside = min(min(t) / max(t) for t in twins)
            print(
                f"{name}, {u} users: slowest/fastest start {min(means) / max(means):.3f} "
                f"({min(means):.1f} .. {max(means):.1f} tok/s over {len(means)} starts); "
                f"widest twin spread inside one start {inside:.3f}"
            )
    machine = [
        s["machine"] for runs in results.values() for r in runs for w in r["levels"].values() for _, s in w
    ]
    print(
        f"fixed work before each window: slowest/fastest {min(machine) / max(machine):.3f} "
        f"({min(machine):.0f} .. {max(machine):.0f} per s over {len(machine)} windows)"
    )


if __name__ == "__main__":
    main()
