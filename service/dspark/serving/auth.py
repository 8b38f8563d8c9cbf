"""Optional bearer-token authentication: every route needs the key except an explicit allow-list
of probes and scrapes."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from dspark.serving.errors import APIError

API_KEY_ENV = "DSPARK_API_KEY"

# Paths open without the key, as path segments; "*" stands for exactly one segment. Anything else
# (inference, model metadata, KServe's model repository `load`/`unload`, docs, unknown paths) needs it.
OPEN_ROUTES = (
    "/health",
    "/ready",
    "/metrics",
    "/v2/health/*",
    "/v2/models/*/ready",
)
_OPEN_PATTERNS = tuple(route.split("/")[1:] for route in OPEN_ROUTES)


def is_open(path: str) -> bool:
    """Whether `path` is on the allow-list: the same number of segments, each equal (or any
    non-empty one for "*"), so that `/health/` or `/v2/models/m/ready/x` is not."""
    segments = path.split("/")[1:]
    return any(
        len(pattern) == len(segments)
        and all(s if p == "*" else p == s for p, s in zip(pattern, segments, strict=True))
        for pattern in _OPEN_PATTERNS
    )


class BearerAuth:
    """401 unless `Authorization: Bearer <key>` matches (when a key is set)."""

    def __init__(self, api_key: str | None):
        self._key = api_key.encode() if api_key else None

    @property
    def enabled(self) -> bool:
        return self._key is not None

    async def __call__(self, request: Request) -> None:
        self.check(request.headers.get("authorization", ""))

    def check(self, authorization: str) -> None:
        """Raise APIError(401) unless the Authorization header carries the key (no-op without a key)."""
        if self._key is None:
            return
        scheme, _, token = authorization.partition(" ")
        # compare_digest: the check takes the same time whatever prefix of the key a caller guessed
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
            raise APIError(
                401,
                "Invalid or missing API key: send `Authorization: Bearer <key>`.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def install(self, app: FastAPI) -> None:
        """Guard every route of `app` but the allow-list (nothing without a key)."""
        if not self.enabled:
            return

        @app.middleware("http")
        async def require_key(request: Request, call_next):
            # A middleware, so that an unauthenticated caller gets 401 before any body parsing,
            # on every route, those added later included.
            if not is_open(request.url.path):
                try:
                    self.check(request.headers.get("authorization", ""))
                except APIError as e:
                    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
            return await call_next(request)
