"""Start and stop the in-process Ray runtime (loopback, no dashboard), or join a running Ray cluster,
and deploy and remove the Serve application."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dspark import OPENMP_ENV
from dspark.models.host_limits import usable_cpus

log = logging.getLogger(__name__)


def _code_path() -> str:
    """PYTHONPATH for Ray workers: the `dspark` package this driver runs (a checkout may shadow an install)."""
    import dspark

    here = str(Path(dspark.__file__).resolve().parents[1])
    rest = os.environ.get("PYTHONPATH")
    return os.pathsep.join([here, rest] if rest else [here])


DAEMON_ENV = {
    # Ray starts its workers at nice 15, as background tasks; a serving replica is the hot path, and
    # at nice 15 anything else on the node (the HTTP proxy, a load generator) preempts its engine.
    "RAY_worker_niceness": "0",
    # Serve's controller reconciles every 0.1 s by default: 27 ms of CPU a second on an idle server,
    # with 21 more in the GCS it polls; 0.5 s cuts the pair to 22 (docs/serving.md). Autoscaling
    # waits 30 s before it scales up, so a reconcile 0.4 s later changes no decision.
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    # Serve runs a replica's own code on a second event loop in a thread by default, so every
    # streamed token crosses from that loop to Ray's, which owns the HTTP server; one loop cuts the
    # replica's CPU per token by about a fifth (docs/serving.md). The constructor then holds Ray's
    # loop while the engine loads, which only delays the replica's first health check.
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    # Ray starts one idle worker per CPU when the driver connects, and holds `ray.init` until they
    # are up: on two cores two more Python interpreters importing Ray, which no Serve actor reuses
    # (each gets a worker of its own) and which compete with the start-up for the same cores.
    "RAY_prestart_worker_first_driver": "0",
}


def _unless_set(defaults: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    return {k: environ.get(k, v) for k, v in defaults.items()}


def daemon_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Ray settings for its daemons and workers (read at their start); a value set in `environ` wins."""
    return _unless_set(DAEMON_ENV, environ)


# When `dspark serve` started (time.time()): the engine's start-up lines count their seconds from it.
STARTED_AT_ENV = "DSPARK_STARTED_AT"


def replica_env(code_path: bool = True) -> dict[str, str]:
    """Environment of the replica processes: the code path (on this machine's Ray only: a cluster's
    nodes have their own install), the server's start time, and OpenMP settings unless set already
    (`dspark.OPENMP_ENV`: a replica may load torch before it imports dspark)."""
    started = {STARTED_AT_ENV: os.environ[STARTED_AT_ENV]} if STARTED_AT_ENV in os.environ else {}
    path = {"PYTHONPATH": _code_path()} if code_path else {}
    return {**path, **started, **_unless_set(OPENMP_ENV, os.environ)}


DIRECT_INGRESS_FLAG = "RAY_SERVE_ENABLE_DIRECT_INGRESS"


DIRECT_INGRESS_DRAINING = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"


def ingress_env(config: Any, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Ray Serve settings for the config's ingress. Ray's processes read them once, at their start.

    Direct ingress (Ray Serve's own mode) runs the replica's ASGI app on a uvicorn server in the
    replica: each streamed token then skips the proxy actor and one Ray streaming hop (1.0 against
    1.8 ms of HTTP-side CPU per token, docs/serving.md). Ray allocates replica ports from a range; a
    range of just the server's port puts the one replica on it, and Ray's proxy moves to a spare port.
    """
    if not config.direct_ingress:
        return {}
    environ = os.environ if environ is None else environ
    return {
        DIRECT_INGRESS_FLAG: "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(config.port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(config.port + 1),  # exclusive
        # Ray holds a stopping direct-ingress replica open this long (30 s by default, and it
        # stretches the drain to match) for a load balancer in front to deregister it. A bare
        # server has nothing in front; a pod's preStop hook waits out kube-proxy before the SIGTERM,
        # inside the pod's grace period. A value in the environment wins.
        DIRECT_INGRESS_DRAINING: environ.get(DIRECT_INGRESS_DRAINING, "0"),
    }


class PortUnavailable(RuntimeError):
    """The configured address cannot be bound."""


def check_port_free(host: str, port: int) -> None:
    """Raise a clear error when something already listens on host:port (Ray would fail obscurely)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise PortUnavailable(f"cannot serve on {host}:{port}: {e.strerror}") from None


def _spare_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_ray(num_cpus: int | None = None, env: dict[str, str] | None = None) -> None:
    """A new local Ray instance bound to 127.0.0.1, without the dashboard (`--address` joins a cluster).

    `env` (see `ingress_env`) goes into this process's environment first: Ray's daemons, and so
    every Serve actor, inherit it.
    """
    import ray

    if ray.is_initialized():
        return
    os.environ.update(env or {})
    os.environ.update(daemon_env(os.environ))
    runtime_env = {"env_vars": replica_env()}
    ray.init(
        # Without an address Ray joins whatever `ray start` left running on the machine (another
        # user's cluster, or one a test started), where num_cpus is refused and Serve would deploy
        # onto someone else's nodes.
        address="local",
        num_cpus=num_cpus or usable_cpus(),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        configure_logging=False,
        runtime_env=runtime_env,
    )


def connect_ray(address: str) -> None:
    """Join the running Ray cluster at `address` (`auto`, `host:port`, `ray://host:10001`) as a driver.

    The cluster's daemons keep their own settings (`DAEMON_ENV` is read when they start); the
    replicas get `replica_env`, less the code path.
    """
    import ray

    if ray.is_initialized():
        return
    ray.init(
        address=address,
        log_to_driver=True,
        configure_logging=False,
        runtime_env={"env_vars": replica_env(code_path=False)},
    )


def run_openai_server(config: Any, engine_factory: Any = None, blocking: bool = False) -> None:
    """Deploy the standalone OpenAI server at config.host:config.port: in its replica when Ray runs
    with direct ingress (`ingress_env`), else on Ray Serve's HTTP proxy."""
    from ray import serve

    from dspark.serving.deployment import APP_NAME, openai_app

    direct = os.environ.get(DIRECT_INGRESS_FLAG) == "1"
    proxy_port = _spare_port(config.host) if direct else config.port
    serve.start(http_options={"host": config.host, "port": proxy_port})
    serve.run(openai_app(config, engine_factory), name=APP_NAME, route_prefix="/", blocking=blocking)


def shutdown(drain: bool = True, keep_cluster: bool = False) -> None:
    """Drain, then stop Serve and Ray; without `drain`, stop Ray at once. With `keep_cluster` (a
    cluster this process joined) delete the application only, and leave Serve and the cluster running.

    Deleting the application first lets each replica finish its in-flight requests (up to
    graceful_shutdown_timeout_s) while the HTTP proxy is still there to carry their responses;
    `serve.shutdown()` alone would stop the proxy under them. A server stopped before it served
    has nothing to drain, and a replica still loading its engine would hold the drain for the whole
    grace period; on a cluster its deletion is still asked for, without waiting for it.
    """
    import ray
    from ray import serve

    from dspark.serving.deployment import APP_NAME

    if not ray.is_initialized():
        return
    if not drain and not keep_cluster:
        ray.shutdown()
        return
    try:
        if APP_NAME in serve.status().applications:
            serve.delete(APP_NAME, _blocking=drain)
        if not keep_cluster:
            serve.shutdown()
    finally:
        ray.shutdown()
