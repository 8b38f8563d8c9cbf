"""The settings Ray's daemons and workers start with."""

from __future__ import annotations

from dspark.serving.runtime import daemon_env


def test_ray_daemons_reconcile_every_half_second_unless_told_otherwise():
    assert daemon_env({}) == {"RAY_worker_niceness": "0", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}
    told = daemon_env({"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1", "RAY_worker_niceness": "5"})
    assert told == {"RAY_worker_niceness": "5", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"}
