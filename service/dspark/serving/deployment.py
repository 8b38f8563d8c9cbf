"""Ray Serve deployments: one replica owns one engine and multiplexes every caller into its batch.

One fixed replica serves HTTP itself (`OpenAIServer`). Several replicas, or a `router` asked for, sit
behind a light HTTP ingress (`OpenAIIngress`) that parses each request and calls the engine
deployment (`EngineBackend`) through its handle, so the engine deployment's request router sees the
prompt (`dspark.serving.request_routers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import generate_latest
from ray import serve
from ray.serve.config import RequestRouterConfig

from dspark.node_resources import REPLICA_SLOTS
from dspark.serving.auth import BearerAuth
from dspark.serving.config import ServeConfig
from dspark.serving.engine_messages import EngineFactory
from dspark.serving.handle_backend import HandleBackend
from dspark.serving.node_placement import on_this_node
from dspark.serving.openai_routes import build_openai_app
from dspark.serving.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from dspark.serving.openai_service import Frame, JSONReply
from dspark.serving.replica import EngineReplica
from dspark.serving.request_routers import ROUTERS
from dspark.serving.router_metrics import REGISTRY as ROUTER_REGISTRY

log = logging.getLogger(__name__)

APP_NAME = "dspark"
# Room above the admission limit for probes and scrapes, so Ray never queues them behind inference.
_CONTROL_HEADROOM = 16
HEALTH_TIMEOUT_S = 5.0  # the ingress's liveness answer waits this long for an engine replica


def _replica(config: dict[str, Any], engine_factory: EngineFactory | None) -> EngineReplica:
    cfg = on_this_node(ServeConfig.model_validate(config))
    if not cfg.engine_in_thread:
        import torch

        # The engine computes in its own process; torch threads here would only contend with it.
        torch.set_num_threads(1)
    return EngineReplica(cfg, factory=engine_factory)


@serve.ingress()
class OpenAIServer:
    """The standalone front end: Ray Serve's HTTP proxy routes straight into this replica's FastAPI app."""

    def __init__(self, config: dict[str, Any], engine_factory: EngineFactory | None = None):
        self.replica = _replica(config, engine_factory)

    def __serve_build_asgi_app__(self):
        r = self.replica
        key = r.config.api_key.get_secret_value() if r.config.api_key else None
        return build_openai_app(
            r.service,
            BearerAuth(key),
            ready=r.ready,
            metrics=r.metrics_text,
            health=r.health,
            max_body_bytes=r.config.max_body_bytes,
        )

    def check_health(self) -> None:
        # Ray Serve calls this every health_check_period_s; raising has Ray replace the replica.
        self.replica.check_health()

    def __del__(self):
        # Ray Serve calls this after draining (graceful_shutdown_timeout_s); stop the engine.
        with contextlib.suppress(Exception):
            self.replica.shutdown()


@serve.ingress()
class OpenAIIngress:
    """The HTTP front end of several engine replicas: FastAPI parses and checks each request here,
    then the call goes through the engine deployment's handle, whose request router sees it."""

    def __init__(self, engine: Any, config: dict[str, Any]):
        self.engine = engine
        self.config = ServeConfig.model_validate(config)

    def __serve_build_asgi_app__(self):
        key = self.config.api_key.get_secret_value() if self.config.api_key else None
        return build_openai_app(
            HandleBackend(self.engine),
            BearerAuth(key),
            ready=self.ready,
            metrics=self.metrics_text,
            health=self.health,
            max_body_bytes=self.config.max_body_bytes,
        )

    async def ready(self) -> bool:
        return bool(await self.engine.ready.remote())

    async def health(self) -> str | None:
        try:
            return await asyncio.wait_for(self.engine.health.remote(), HEALTH_TIMEOUT_S)
        except Exception as e:  # no replica answers (being replaced): not healthy either
            return f"no engine replica answered: {type(e).__name__}"

    async def metrics_text(self) -> bytes:
        """One engine replica's metrics, then this process's router metrics."""
        return await self.engine.metrics_text.remote() + generate_latest(ROUTER_REGISTRY)


class EngineBackend:
    """The engine replica behind a front end (the ingress deployment, or KServe's), reached through
    a deployment handle."""

    def __init__(self, config: dict[str, Any], engine_factory: EngineFactory | None = None):
        self.replica = _replica(config, engine_factory)

    async def openai(
        self, route: str, body: CompletionRequest | ChatCompletionRequest
    ) -> AsyncIterator[Frame]:
        async for frame in self.replica.openai(route, body):
            yield frame

    async def infer_v2(self, inputs: list[str], parameters: dict[str, Any]) -> list[str] | JSONReply:
        return await self.replica.infer_v2(inputs, parameters)

    async def models(self) -> dict[str, Any]:
        return await self.replica.models()

    async def tokenize(self, body: TokenizeRequest) -> JSONReply:
        return await self.replica.service.tokenize(body)

    async def detokenize(self, body: DetokenizeRequest) -> JSONReply:
        return await self.replica.service.detokenize(body)

    async def ready(self) -> bool:
        return await self.replica.ready()

    async def health(self) -> str | None:
        return await self.replica.health()

    def check_health(self) -> None:
        self.replica.check_health()

    async def metrics_text(self) -> bytes:
        return await self.replica.metrics_text()

    async def model_name(self) -> str:
        return self.replica.model_name

    def __del__(self):
        with contextlib.suppress(Exception):
            self.replica.shutdown()


def deployment_options(config: ServeConfig) -> dict[str, Any]:
    """Ray Serve options from the config: replicas or autoscaling, resources, queue and shutdown.

    Placed by node type, a replica takes one replica slot of a profiled node, which stands for its
    share of the node: it reserves CPUs only where `num_cpus_per_replica` says how many (this
    machine's CPUs say nothing about a cluster node's).
    """
    max_num_seqs = config.engine_config().max_num_seqs
    actor: dict[str, Any] = {"num_cpus": config.replica_cpus(), "num_gpus": config.num_gpus_per_replica}
    if config.placed_by_node_type:
        actor["num_cpus"] = config.num_cpus_per_replica or 0.0
        actor["resources"] = {REPLICA_SLOTS: 1.0}
    opts: dict[str, Any] = {
        "max_ongoing_requests": max_num_seqs + config.max_queue + _CONTROL_HEADROOM,
        "ray_actor_options": actor,
        "graceful_shutdown_timeout_s": config.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": 0.5,
        "health_check_period_s": 10.0,
    }
    if config.autoscaling is not None:
        a = config.autoscaling
        opts["autoscaling_config"] = {
            "min_replicas": a.min_replicas,
            "max_replicas": a.max_replicas,
            "target_ongoing_requests": a.target_ongoing_requests,
            "upscale_delay_s": a.upscale_delay_s,
            "downscale_delay_s": a.downscale_delay_s,
        }
    else:
        opts["num_replicas"] = config.num_replicas
    router = ROUTERS[config.engine_router] if config.engine_router else None
    if router is not None:
        opts["request_router_config"] = RequestRouterConfig(request_router_class=router)
    return opts


def ingress_options(config: ServeConfig) -> dict[str, Any]:
    """The ingress takes no CPU of its own (it waits on the engines) and admits what they all admit."""
    engine = deployment_options(config)
    return {
        "num_replicas": 1,
        "max_ongoing_requests": engine["max_ongoing_requests"] * config.max_replicas,
        "ray_actor_options": {"num_cpus": 0},
        "graceful_shutdown_timeout_s": config.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": 0.5,
    }


def openai_app(config: ServeConfig, engine_factory: EngineFactory | None = None):
    """The bound Ray Serve application of the standalone server: the one replica serving HTTP itself,
    or the ingress in front of the routed engine replicas (`config.routed`)."""
    if config.routed:
        ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress", **ingress_options(config))
        return ingress.bind(engine_backend_app(config, engine_factory), config.model_dump(mode="python"))
    dep = serve.deployment(OpenAIServer, name="OpenAIServer", **deployment_options(config))
    return dep.bind(config.model_dump(mode="python"), engine_factory)


def engine_backend_app(config: ServeConfig, engine_factory: EngineFactory | None = None):
    """The bound engine deployment a front end talks to (no HTTP route of its own)."""
    dep = serve.deployment(EngineBackend, name="EngineBackend", **deployment_options(config))
    return dep.bind(config.model_dump(mode="python"), engine_factory)
