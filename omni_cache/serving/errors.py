"""Errors as the client sees them: OpenAI-style JSON ``{"error": {"message", "type", "param",
"code"}}`` with the HTTP status, and the app's exception handlers that answer every failure that
way (our own, the orchestrator's, FastAPI's, routing's, and unexpected ones as 500)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from omni_cache.runtime.results import RequestError

# The server's logger: "internal error" lines keep the name they were always logged under.
logger = logging.getLogger(__name__)

__all__ = ["APIError", "add_error_handlers", "invalid_request"]

# status -> (type, code) when the raiser does not say.
_ERROR_TYPES = {
    400: ("invalid_request_error", None),
    401: ("authentication_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    # OpenAI's own 429 body: {"type": "requests", "code": "rate_limit_exceeded"}
    429: ("requests", "rate_limit_exceeded"),
    499: ("client_closed_request", None),
    500: ("server_error", None),
    503: ("service_unavailable", "stage_unavailable"),
    504: ("timeout", "request_timeout"),
}


class APIError(Exception):
    """An error answered as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        default_type, default_code = _ERROR_TYPES.get(status, ("server_error", None))
        self.status = status
        self.message = message
        self.type = type or default_type
        self.param = param
        self.code = code if code is not None else default_code
        #: Seconds until the client may try again: the ``Retry-After`` header.
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())

    @classmethod
    def from_request_error(cls, e: RequestError) -> APIError:
        return cls(e.status, e.message, retry_after=e.retry_after)


def invalid_request(exc: ValidationError) -> APIError:
    """A request body that did not validate: bad JSON, or the first three field errors."""
    errors = exc.errors()
    first = errors[0] if errors else {"type": "", "loc": (), "msg": str(exc)}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error") or first.get("msg")
        return APIError(400, f"invalid JSON body: {detail}", code="invalid_json")
    parts = []
    for err in errors[:3]:
        loc = ".".join(str(p) for p in err.get("loc", ())) or "request body"
        parts.append(f"{loc}: {err.get('msg')}")
    if len(errors) > 3:
        parts.append(f"({len(errors) - 3} more)")
    param = ".".join(str(p) for p in first.get("loc", ())) or None
    return APIError(400, "invalid request: " + "; ".join(parts), param=param)


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
    return APIError.from_request_error(exc).response()


async def _fastapi_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    return APIError(400, f"invalid request: {exc.errors()}").response()


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return APIError(exc.status_code, str(exc.detail)).response()


async def _internal(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()


def add_error_handlers(app: FastAPI) -> None:
    """Answer every failure of ``app`` as OpenAI-style JSON."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(RequestValidationError, _fastapi_validation)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
