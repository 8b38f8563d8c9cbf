"""CPU seconds by process of a `dspark serve` start, up to its first answers.

    python scripts/startup_cpu.py [--warm] [dspark serve flags]

Runs `scripts/first_answer.sh` with the same arguments (and its CACHE_ROOT, PORT, DSPARK_BIN) and
samples every process of its tree five times a second: the driver, Ray's daemons, Serve's
controller and proxy, the replica and its engine process. CPU seconds, unlike wall-clock times,
stay comparable on a shared machine; a process that exits between two samples loses its last
0.2 s. Prints one line per process and the sums by role.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROLES = (
    ("dspark.serving.engine_core", "engine process"),
    ("ServeReplica", "replica"),
    ("ServeController", "serve controller"),
    ("ProxyActor", "serve proxy"),
    ("DashboardAgent", "ray dashboard agent"),
    ("RuntimeEnvAgent", "ray runtime-env agent"),
    ("ray::IDLE", "ray idle worker"),
    ("default_worker.py", "ray idle worker"),
    ("dashboard/dashboard.py", "ray dashboard head"),
    ("autoscaler", "ray autoscaler monitor"),
    ("log_monitor", "ray log monitor"),
    ("gcs_server", "ray gcs"),
    ("raylet", "raylet"),
    ("dspark.cli", "driver (dspark serve)"),
    ("bin/dspark", "driver (dspark serve)"),
    ("first_answer.sh", "script"),
)


def role(cmdline: list[str]) -> str:
    text = " ".join(cmdline)
    for key, name in ROLES:
        if key in text:
            return name
    return "other: " + text[:50].replace("\n", " ")


def main(args: list[str]) -> None:
    script = Path(__file__).with_name("first_answer.sh")
    started = time.monotonic()
    top = subprocess.Popen(["bash", str(script), *args])
    seen: dict[int, list] = {}  # pid -> [role, first seen s, CPU s]
    root = psutil.Process(top.pid)
    while top.poll() is None:
        try:
            tree = root.children(recursive=True)
        except psutil.Error:
            break
        for p in tree:
            try:
                cpu = sum(p.cpu_times()[:2])
                name = role(p.cmdline())
            except psutil.Error:
                continue
            entry = seen.setdefault(p.pid, [name, time.monotonic() - started, 0.0])
            entry[0] = name if not name.startswith("other") else entry[0]  # Ray retitles its workers
            entry[2] = cpu
        time.sleep(0.2)
    totals: dict[str, float] = collections.defaultdict(float)
    for pid, (name, first, cpu) in sorted(seen.items(), key=lambda kv: kv[1][1]):
        if cpu >= 0.05:
            print(f"{pid:>8}  {name:<32} from {first:6.1f} s  {cpu:6.2f} s CPU")
        totals[name] += cpu
    print("by role:")
    for name, cpu in sorted(totals.items(), key=lambda kv: -kv[1]):
        if cpu >= 0.05:
            print(f"  {name:<40} {cpu:6.2f} s CPU")
    print(f"  {'all':<40} {sum(totals.values()):6.2f} s CPU in {time.monotonic() - started:.1f} s")
    sys.exit(top.returncode)


if __name__ == "__main__":
    main(sys.argv[1:])
