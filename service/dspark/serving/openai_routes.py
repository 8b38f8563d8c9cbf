"""The HTTP face of the OpenAI-compatible API (FastAPI), shared by the Ray Serve and KServe front ends."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.serving.auth import BearerAuth
from dspark.serving.body_limit import BodyLimit
from dspark.serving.errors import APIError, error_body, validation_message
from dspark.serving.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    tokenize_request,
)
from dspark.serving.openai_service import Frame, JSONReply
from dspark.serving.request_limits import RequestLimits

log = logging.getLogger(__name__)


class OpenAIBackend(Protocol):
    """What the routes call: an `OpenAIService` in this process, or a proxy to a Ray Serve replica."""

    def completion(self, req: CompletionRequest) -> AsyncIterator[Frame]: ...

    def chat(self, req: ChatCompletionRequest) -> AsyncIterator[Frame]: ...

    async def models(self) -> dict[str, Any]: ...

    async def tokenize(self, req: TokenizeRequest) -> JSONReply: ...

    async def detokenize(self, req: DetokenizeRequest) -> JSONReply: ...


async def to_response(frames: AsyncIterator[Frame]) -> Response:
    """One JSON reply, or an SSE stream whose generator is closed (aborting the request) on disconnect."""
    it = aiter(frames)
    try:
        first = await anext(it)
    except StopAsyncIteration:
        return JSONResponse(error_body(500, "the request produced no reply"), status_code=500)
    if isinstance(first, JSONReply):
        await it.aclose()
        return JSONResponse(first.body, status_code=first.status, headers=first.headers)

    async def events() -> AsyncIterator[str]:
        try:
            async for frame in it:
                yield frame
        finally:
            await it.aclose()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _reply(reply: JSONReply) -> JSONResponse:
    return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-style body; validation problems are 400, never 422 or 5xx."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(e.errors()))
        return JSONResponse(error_body(400, message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(e.status_code, str(e.detail)),
            status_code=e.status_code,
            headers=getattr(e, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}"), status_code=500)


def build_openai_app(
    backend: OpenAIBackend,
    auth: BearerAuth,
    *,
    ready: Callable[[], Awaitable[bool]] | None = None,
    metrics: Callable[[], Awaitable[bytes]] | None = None,
    health: Callable[[], Awaitable[str | None]] | None = None,
    title: str = "DSpark Serve",
    max_body_bytes: int = RequestLimits.max_body_bytes,
) -> FastAPI:
    """The OpenAI routes and vLLM's /tokenize and /detokenize; with `ready`/`metrics`, also /health,
    /ready and /metrics (open without the key, as every other route is not: `auth.OPEN_ROUTES`).
    `health` says why the replica cannot serve (its engine dead or hung), or None."""
    app = FastAPI(title=title, version="1", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    auth.install(app)  # outside the body limit: a caller without the key learns nothing of it

    @app.post("/v1/completions", responses={400: {}, 401: {}, 404: {}, 429: {}})
    async def completions(body: CompletionRequest) -> Response:
        return await to_response(backend.completion(body))

    @app.post("/v1/chat/completions", responses={400: {}, 401: {}, 404: {}, 429: {}})
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        return await to_response(backend.chat(body))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return await backend.models()

    @app.post("/tokenize", responses={400: {}, 401: {}, 404: {}})
    async def tokenize(request: Request) -> JSONResponse:
        # A prompt or messages: the body's keys choose the schema, so errors name the fields.
        try:
            body = tokenize_request(await request.json())
        except json.JSONDecodeError:
            return JSONResponse(error_body(400, "the body is not valid JSON"), status_code=400)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        return _reply(await backend.tokenize(body))

    @app.post("/detokenize", responses={400: {}, 401: {}, 404: {}})
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        return _reply(await backend.detokenize(body))

    if ready is not None:

        @app.get("/health", responses={503: {}})
        async def is_healthy() -> JSONResponse:
            problem = await health() if health is not None else None
            if problem is None:
                return JSONResponse({"status": "ok"})
            return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)

        @app.get("/ready", responses={503: {}})
        async def is_ready() -> JSONResponse:
            ok = await ready()
            return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    if metrics is not None:

        @app.get("/metrics", response_class=PlainTextResponse)
        async def prometheus() -> Response:
            return Response(await metrics(), media_type=CONTENT_TYPE_LATEST)

    return app
