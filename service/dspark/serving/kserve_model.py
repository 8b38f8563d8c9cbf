"""The KServe front end: `kserve.ModelServer` over the engine's Ray Serve deployment.

The model is a `kserve.ray.RayModel` whose calls go to the `EngineBackend` deployment through its
handle. KServe answers the Open Inference Protocol v2 (`/v2/health/*`, `/v2/models/{name}`,
`/v2/models/{name}/infer`, text in `text_input`, text out `text_output`). KServe's own OpenAI layer
needs vLLM, so the OpenAI routes are ours, mounted where KServe puts its own: `/openai/v1/...`.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from dspark.serving.auth import BearerAuth
from dspark.serving.body_limit import BodyLimit
from dspark.serving.config import ServeConfig
from dspark.serving.handle_backend import HandleBackend
from dspark.serving.openai_routes import build_openai_app
from dspark.serving.openai_service import JSONReply
from dspark.serving.replica import V2_INPUT, V2_OUTPUT

OPENAI_PREFIX = "/openai"
HEALTH_TIMEOUT_S = 5.0  # a liveness probe waits this long for the engine replica


def _import_kserve():
    """`kserve.model_server` parses sys.argv on import: hide ours from it."""
    saved, sys.argv = sys.argv, sys.argv[:1]
    try:
        import kserve
        import kserve.model_server
        import kserve.ray
    finally:
        sys.argv = saved
    return kserve


kserve = _import_kserve()
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse  # noqa: E402
from kserve.protocol.rest.server import RESTServer  # noqa: E402


class DSparkRayModel(kserve.ray.RayModel):
    """Text-in, text-out v2 inference and readiness, delegated to the engine replicas."""

    def load(self) -> bool:
        self.ready = True  # the deployment loaded its engine before serve.run returned
        return True

    async def healthy(self) -> bool:
        return bool(await self._handle.ready.remote())

    async def get_input_types(self) -> list[dict[str, Any]]:
        return [{"name": V2_INPUT, "datatype": "BYTES", "shape": [-1]}]

    async def get_output_types(self) -> list[dict[str, Any]]:
        return [{"name": V2_OUTPUT, "datatype": "BYTES", "shape": [-1]}]

    async def __call__(self, body: Any, headers: dict[str, str] | None = None, verb: Any = None):
        if not isinstance(body, InferRequest):
            raise HTTPException(400, "this model speaks the v2 protocol: POST /v2/models/{name}/infer")
        texts = _input_texts(body)
        params = dict(body.parameters or {})
        result = await self._handle.infer_v2.remote(texts, params)
        if isinstance(result, JSONReply):
            raise HTTPException(
                result.status, result.body.get("error") or result.body, headers=result.headers or None
            )
        out = InferOutput(name=V2_OUTPUT, shape=[len(result)], datatype="BYTES", data=result)
        return InferResponse(
            response_id=body.id or uuid.uuid4().hex, model_name=self.name, infer_outputs=[out]
        ), {}


def _input_texts(body: InferRequest) -> list[str]:
    inp = body.get_input_by_name(V2_INPUT) or (body.inputs[0] if len(body.inputs) == 1 else None)
    if inp is None:
        raise HTTPException(400, f"expected one BYTES input named `{V2_INPUT}`")
    if inp.datatype != "BYTES":
        raise HTTPException(400, f"input `{inp.name}` must have datatype BYTES, not {inp.datatype}")
    data = inp.data if isinstance(inp.data, list) else [inp.data]
    flat: list[Any] = []
    for item in data:
        flat.extend(item if isinstance(item, list) else [item])
    texts = []
    for item in flat:
        if isinstance(item, bytes):
            try:
                item = item.decode("utf-8")
            except UnicodeDecodeError:
                raise HTTPException(400, "input text must be UTF-8") from None
        if not isinstance(item, str):
            raise HTTPException(400, "input data must be strings")
        texts.append(item)
    return texts


def _install_front_routes(app: FastAPI, handle: Any, auth: BearerAuth, max_body_bytes: int) -> None:
    """/health, /ready, /metrics and the OpenAI routes; the key on every route of the app but the
    allow-list (`auth.OPEN_ROUTES`), KServe's own v1/v2 and model-repository routes included."""

    @app.get("/health", responses={503: {}})
    async def health() -> JSONResponse:
        try:
            problem = await asyncio.wait_for(handle.health.remote(), HEALTH_TIMEOUT_S)
        except Exception as e:  # no replica answers (being replaced): not healthy either
            problem = f"the engine replica did not answer: {type(e).__name__}"
        if problem is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = bool(await handle.ready.remote())
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        # The engine's metrics (from a replica) followed by the KServe front end's own.
        return Response(
            await handle.metrics_text.remote() + generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST
        )

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    auth.install(app)
    openai = build_openai_app(
        HandleBackend(handle), auth, title="DSpark Serve (KServe)", max_body_bytes=max_body_bytes
    )
    app.mount(OPENAI_PREFIX, openai)


def build_kserve_server(config: ServeConfig, handle: Any, model_name: str) -> RESTServer:
    """KServe's REST server with the engine registered as `model_name`, bound to config.host:port."""
    key = config.api_key.get_secret_value() if config.api_key else None
    _install_front_routes(kserve.model_server.app, handle, BearerAuth(key), config.max_body_bytes)
    model = DSparkRayModel(model_name, handle)
    model.load()
    server = kserve.ModelServer(
        http_port=config.port, enable_grpc=False, grace_period=int(config.graceful_shutdown_timeout_s)
    )
    server.register_model(model)
    rest = RESTServer(
        kserve.model_server.FASTAPI_APP_IMPORT_STRING,
        server.dataplane,
        server.model_repository_extension,
        config.port,
        grace_period=int(config.graceful_shutdown_timeout_s),
    )
    rest.config.host = config.host  # KServe hard-codes 0.0.0.0; the container sets host explicitly
    return rest


def deploy_engine_backend(config: ServeConfig, engine_factory: Any = None) -> tuple[Any, str]:
    """Start the engine deployment without an HTTP proxy; return its handle and model name."""
    from ray import serve

    from dspark.serving.deployment import APP_NAME, engine_backend_app

    serve.start(proxy_location="Disabled")
    handle = serve.run(engine_backend_app(config, engine_factory), name=APP_NAME, route_prefix=None)
    return handle, handle.model_name.remote().result()
