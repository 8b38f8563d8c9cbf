"""The settings Ray's daemons and workers start with."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import ray
from dspark.serving import runtime
from dspark.serving.runtime import daemon_env

pytestmark = pytest.mark.real_server

DEFAULTS = {
    "RAY_worker_niceness": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_prestart_worker_first_driver": "0",
}


def test_ray_daemons_get_the_serving_settings_unless_told_otherwise():
    assert daemon_env({}) == DEFAULTS
    told = daemon_env({"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1", "RAY_worker_niceness": "5"})
    assert told == {**DEFAULTS, "RAY_worker_niceness": "5", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"}


def test_the_installed_ray_serve_reads_the_settings():
    # A Ray release that renamed a setting would ignore it silently; its constants module must see each.
    env = {**os.environ, **DEFAULTS}
    code = (
        "from ray.serve._private import constants as c;"
        "print(c.CONTROL_LOOP_INTERVAL_S, c.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0.5", "False"]


def test_ray_starts_no_idle_workers_with_the_settings():
    # Ray would otherwise start (and wait for) one idle worker per CPU when the driver connects.
    code = (
        "import psutil, ray;"
        "ray.init(num_cpus=2, include_dashboard=False, _node_ip_address='127.0.0.1');"
        "kids = psutil.Process().children(recursive=True);"
        "idle = lambda c: c[0].startswith('ray::IDLE') or c[1:2] and c[1].endswith('default_worker.py');"
        "print(sum(1 for p in kids if idle(p.cmdline() or [''])));"
        "ray.shutdown()"
    )
    env = {**os.environ, **DEFAULTS}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "0"


def test_serve_starts_its_own_ray_even_where_a_cluster_runs(monkeypatch):
    """Only --address joins a running cluster: ray.init without one would attach to it."""
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(runtime.os, "environ", dict(os.environ))
    runtime.start_ray(num_cpus=1)
    assert calls and calls[0]["address"] == "local" and calls[0]["num_cpus"] == 1
