"""Start and stop the in-process Ray runtime and the Serve applications (loopback, no dashboard)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from dspark import OPENMP_ENV

log = logging.getLogger(__name__)


def _code_path() -> str:
    """PYTHONPATH for Ray workers: the `dspark` package this driver runs (a checkout may shadow an install)."""
    import dspark

    here = str(Path(dspark.__file__).resolve().parents[1])
    rest = os.environ.get("PYTHONPATH")
    return os.pathsep.join([here, rest] if rest else [here])


# Ray starts its workers at nice 15, as background tasks; a serving replica is the hot path, and at
# nice 15 anything else on the node (the HTTP proxy, a load generator) preempts its engine thread.
WORKER_NICENESS = "0"


def replica_env() -> dict[str, str]:
    """Environment of the replica processes: the code path, and OpenMP settings unless set already
    (`dspark.OPENMP_ENV`: a replica may load torch before it imports dspark)."""
    env = {"PYTHONPATH": _code_path()}
    env.update({k: os.environ.get(k, v) for k, v in OPENMP_ENV.items()})
    return env


def start_ray(num_cpus: int | None = None) -> None:
    """A local Ray instance bound to 127.0.0.1, without the dashboard; reuses one already running."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_worker_niceness", WORKER_NICENESS)
    runtime_env = {"env_vars": replica_env()}
    ray.init(
        num_cpus=num_cpus or os.cpu_count() or 1,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        configure_logging=False,
        runtime_env=runtime_env,
    )


def run_openai_server(config: Any, engine_factory: Any = None, blocking: bool = False) -> None:
    """Deploy the standalone OpenAI server on Ray Serve's HTTP proxy at config.host:config.port."""
    from ray import serve

    from dspark.serving.deployment import APP_NAME, openai_app

    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(openai_app(config, engine_factory), name=APP_NAME, route_prefix="/", blocking=blocking)


def shutdown() -> None:
    """Drain, then stop Serve and Ray.

    Deleting the application first lets each replica finish its in-flight requests (up to
    graceful_shutdown_timeout_s) while the HTTP proxy is still there to carry their responses;
    `serve.shutdown()` alone would stop the proxy under them.
    """
    import ray
    from ray import serve

    from dspark.serving.deployment import APP_NAME

    if not ray.is_initialized():
        return
    try:
        if APP_NAME in serve.status().applications:
            serve.delete(APP_NAME, _blocking=True)
        serve.shutdown()
    finally:
        ray.shutdown()
