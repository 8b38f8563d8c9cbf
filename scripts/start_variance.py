"""How much one server's speed depends on its start: N starts of each configuration, each measured
at 1 and 16 users with the same closed-loop HTTP client, once its compiled path is on.

Prints every start's figures and the thread plan it chose, then per configuration and level the
slowest start over the fastest.

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

from dspark.bench.http_load import run_level, wait_until_serving
from dspark.bench.peer import bench_prompts, free_port

COMPILED = "compiled the target's forward"
PLAN = re.compile(r"one request steps on (\d+) intra-op threads[^\n]*")


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
        levels = {
            users: run_level(base, "smollm2-135m", prompts, users, max(2 * users, 8), args.max_tokens)
            for users in args.users
        }
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=120)
    plan = PLAN.search(log.read_text(errors="replace"))
    return {"levels": levels, "plan": plan.group(0) if plan else "no plan line"}


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
            speeds = " | ".join(f"{r['levels'][u].aggregate_tokens_per_s:.1f}" for u in args.users)
            print(f"| {name} | {i + 1} | {speeds} | {r['plan']} |", flush=True)
    for name, runs in results.items():
        for u in args.users:
            speeds = [r["levels"][u].aggregate_tokens_per_s for r in runs]
            print(
                f"{name}, {u} users: slowest/fastest {min(speeds) / max(speeds):.3f} "
                f"({min(speeds):.1f} .. {max(speeds):.1f} tok/s over {len(speeds)} starts)"
            )


if __name__ == "__main__":
    main()
