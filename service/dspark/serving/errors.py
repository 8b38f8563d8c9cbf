"""OpenAI-style error bodies and the exceptions the serving layer raises for them."""

from __future__ import annotations

from typing import Any

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "BadRequestError",
    415: "BadRequestError",
    422: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


class APIError(Exception):
    """An error with an HTTP status that the client should see as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    """The body OpenAI clients parse: {"error": {"message", "type", "param", "code"}}."""
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError"),
            "param": param,
            "code": code if code is not None else status,
        }
    }


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Turn pydantic's error list into one readable message and the first offending parameter."""
    parts, param = [], None
    for err in errors[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        where = ".".join(loc) or "body"
        param = param or (where if loc else None)
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(msg if where == "body" and err.get("type") == "value_error" else f"{where}: {msg}")
    if len(errors) > 5:
        parts.append(f"... and {len(errors) - 5} more")
    return "; ".join(parts) or "invalid request", param
