"""Run one SLA scenario as a headless Locust process, bounded in time, and read its report back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import dspark_loadtest

LOCUSTFILE = Path(dspark_loadtest.__file__).resolve().parent / "locustfile.py"
STOP_TIMEOUT_S = 5  # in-flight requests may finish this long after the scenario ends, then are cut


@dataclass
class ScenarioResult:
    returncode: int
    prefix: Path
    output: str

    @property
    def report(self) -> dict | None:
        path = self.prefix.with_name(self.prefix.name + "_sla.json")
        return json.loads(path.read_text()) if path.exists() else None


def locust_command(
    host: str,
    prefix: Path,
    scenario_seconds: float,
    options: dict[str, object],
    web_port: int | None = None,
    stop_timeout_s: int = STOP_TIMEOUT_S,
) -> list[str]:
    """The Locust command line; `options` are the plugin's (`tier`, `concurrency`, ...), None/"" left out.

    The tier's shape ends the run (Locust ignores `--run-time` when a shape is present); `run_scenario`
    kills a process that outlives it. With `web_port` the run starts at once with the web UI on
    loopback, and the process quits a minute after the run.
    """
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--host",
        host,
        "--csv",
        str(prefix),
        "--html",
        f"{prefix}.html",
        "--report-prefix",
        str(prefix),
        "--stop-timeout",
        str(stop_timeout_s),
    ]
    if web_port is None:
        cmd += ["--headless", "--only-summary"]
    else:
        cmd += ["--web-host", "127.0.0.1", "--web-port", str(web_port), "--autostart", "--autoquit", "60"]
    for key, value in options.items():
        if value is not None and value != "":
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    return cmd


def child_env(api_key: str | None = None) -> dict[str, str]:
    """The Locust process's environment: this interpreter's packages importable from the locustfile, and
    the API key (kept off the command line, where other users of the machine could read it)."""
    import dspark

    roots = {
        str(Path(dspark_loadtest.__file__).resolve().parents[1]),
        str(Path(dspark.__file__).resolve().parents[1]),
    }
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*sorted(roots), *filter(None, [env.get("PYTHONPATH")])])
    if api_key:
        env["DSPARK_API_KEY"] = api_key
    return env


def run_scenario(
    host: str,
    prefix: Path,
    scenario_seconds: float,
    options: dict[str, object],
    web_port: int | None = None,
    echo: bool = False,
    stop_timeout_s: int = STOP_TIMEOUT_S,
) -> ScenarioResult:
    """Run Locust to completion (killed if it outlives its bound) and return its exit code and output."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    options = dict(options)
    api_key = options.pop("api_key", None)
    cmd = locust_command(host, prefix, scenario_seconds, options, web_port, stop_timeout_s)
    bound = scenario_seconds + stop_timeout_s + 120 + (60 if web_port else 0)
    try:
        proc = subprocess.run(
            cmd, env=child_env(api_key), capture_output=not echo, text=True, timeout=bound, check=False
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or "") + (e.stderr or "") if isinstance(e.stdout, str) else ""
        return ScenarioResult(124, prefix, out + f"\nlocust killed after {bound:.0f} s")
    return ScenarioResult(proc.returncode, prefix, (proc.stdout or "") + (proc.stderr or ""))
