"""413 for a request body above a size limit, before the body is parsed (an ASGI middleware)."""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException

from dspark.serving.errors import error_body

Scope = dict[str, Any]
DRAIN_BYTES = 64 * 2**20


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a body without a (truthful) Content-Length passes the limit. An
    HTTPException, so that FastAPI's body parsing passes it on to the app's handler (a 413) instead
    of turning it into a 400."""

    def __init__(self, max_bytes: int):
        super().__init__(413, _message(max_bytes, max_bytes + 1))


class BodyLimit:
    """Answers 413 when Content-Length announces more than `max_bytes`, and cuts off a body that
    turns out longer than that while it is read (chunked). The rest of the body is read and dropped
    first (up to `DRAIN_BYTES`), so that the client gets to read the answer."""

    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            await _drain(receive)
            await self._reject(send, length)
            return
        received = 0
        started = False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    if message.get("more_body", False):
                        await _drain(receive)
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._reject(send, received)

    async def _reject(self, send, size: int) -> None:
        body = json.dumps(error_body(413, _message(self.max_bytes, size), code="request_too_large")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def _drain(receive) -> None:
    """Read and drop what the client still sends, up to `DRAIN_BYTES`: a client that is still
    writing its body when the server closes the connection gets a reset instead of the 413."""
    drained = 0
    while drained < DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _message(max_bytes: int, size: int) -> str:
    return f"the request body has {size} bytes or more; the limit is {max_bytes} bytes (max_body_bytes)"


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
