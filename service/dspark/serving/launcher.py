"""`dspark serve`: bring up Ray in-process (or join a cluster), deploy the engine, serve until
interrupted, then drain."""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time

from dspark.models.host_limits import usable_cpus
from dspark.serving.config import ServeConfig
from dspark.serving.engine_prestart import PrestartedEngine, prestart_environment, should_prestart
from dspark.serving.engine_process import engine_env
from dspark.serving.runtime import (
    STARTED_AT_ENV,
    check_port_free,
    connect_ray,
    ingress_env,
    replica_env,
    run_openai_server,
    shutdown,
    start_ray,
)

log = logging.getLogger(__name__)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def prepare_model(config: ServeConfig) -> None:
    """Fetch the target (and a drafter given by hub id) here, with progress and clean errors, before
    replicas try to load them."""
    from dspark.drafters.factory import LOOKUP_FIRST, checkpoint_dir, split_kind
    from dspark.models.hub import parse_hub_id
    from dspark.models.pull import resolve_target

    engine = config.engine_config()
    resolve_target(engine.target)
    _, drafter = split_kind(engine.drafter.removeprefix(LOOKUP_FIRST))
    if parse_hub_id(drafter) is not None:
        checkpoint_dir(drafter)


def prestart_engine(config: ServeConfig) -> PrestartedEngine | None:
    """The replica's engine process, started now with the environment the replica would give it:
    its imports (seconds) then overlap Ray's and Serve's start instead of following them."""
    if not should_prestart(config):
        return None
    worker_env = prestart_environment(config, {**os.environ, **replica_env()})
    return PrestartedEngine(engine_env(config.engine_cpus(os.sched_getaffinity(0)), worker_env))


def serve_forever(config: ServeConfig, announce=print) -> None:
    """Run the configured front end in the foreground; SIGINT/SIGTERM drain in-flight requests and stop.

    Each start-up stage is announced with the seconds since the start; the engine's own lines carry
    the same clock ($DSPARK_STARTED_AT). With `config.address` the application goes onto that Ray
    cluster's Serve (its HTTP proxies, its replicas' nodes fetch the model), and on the way out it is
    deleted while the cluster keeps running.
    """
    started = time.time()
    os.environ[STARTED_AT_ENV] = repr(started)

    def stage(message: str) -> None:
        announce(f"[+{time.time() - started:.1f} s] {message}")

    on_cluster = config.address is not None
    if not on_cluster:
        check_port_free(config.host, config.port)
    prestarted = prestart_engine(config)
    try:
        _serve(config, announce, stage, prestarted)
    finally:
        if prestarted is not None:
            prestarted.close()


def _serve(config: ServeConfig, announce, stage, prestarted: PrestartedEngine | None) -> None:
    on_cluster = config.address is not None
    if on_cluster:
        stage(f"joining the Ray cluster at {config.address}")
        connect_ray(config.address)
    else:
        prepare_model(config)
        stage("model ready; starting Ray")
        cpus = max(usable_cpus(), math.ceil(config.replica_cpus() * config.max_replicas))
        start_ray(num_cpus=cpus, env=ingress_env(config) | (prestarted.replica_env() if prestarted else {}))
    # After ray.init: Ray's core worker installs a SIGTERM handler that kills the driver on the spot.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    stage(
        "starting the engine: weights, then an SPS profile where none is stored"
        + (" (a few seconds; compiling follows in the background)" if config.build_in_background else "")
    )
    serving = False
    try:
        if config.kserve:
            from dspark.serving.kserve_model import build_kserve_server, deploy_engine_backend

            handle, name = deploy_engine_backend(config)
            serving = True
            stage(
                f"KServe model `{name}` on http://{config.host}:{config.port} "
                f"(v2: /v2/models/{name}/infer, OpenAI: /openai/v1)"
            )
            build_kserve_server(config, handle, name).run()
        else:
            run_openai_server(config)
            serving = True
            if on_cluster:
                from dspark.serving.deployment import APP_NAME

                stage(
                    f"DSpark Serve on the Ray cluster at {config.address}: application `{APP_NAME}` at "
                    "route / of its Serve HTTP proxies (OpenAI API under /v1); Ctrl-C deletes it"
                )
            else:
                stage(
                    f"DSpark Serve on http://{config.host}:{config.port} (OpenAI API under /v1); "
                    "Ctrl-C stops it"
                )
            threading.Event().wait()
    except KeyboardInterrupt:
        announce(
            "shutting down: draining in-flight requests" if serving else "stopping before start-up finished"
        )
    finally:
        # Ray re-delivers pending signals while it waits; the drain must not be cut short by them.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        shutdown(drain=serving, keep_cluster=on_cluster)
        announce("stopped")
