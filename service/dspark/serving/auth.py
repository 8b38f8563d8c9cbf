"""Optional bearer-token authentication of the inference routes (probes and scrapes stay open)."""

from __future__ import annotations

import hmac

from fastapi import Request

from dspark.serving.errors import APIError

API_KEY_ENV = "DSPARK_API_KEY"


def is_guarded(path: str) -> bool:
    """Inference and model routes (`/v1/...`, also under a prefix such as KServe's `/openai`)."""
    return "/v1/" in path or path.endswith("/v1")


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
