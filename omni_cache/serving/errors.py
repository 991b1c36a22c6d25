"""Errors as the client sees them: the bodies and status codes ``vllm serve`` gives,
``{"error": {"message", "type", "param", "code"}}`` with ``code`` the HTTP status, made by vLLM's
own exception handlers where vLLM has one (a body that does not validate, a ``VLLMError`` such as
``VLLMValidationError``, a ``ValueError`` raised while handling a request) and in the same shape for
the pipeline's own failures (:class:`APIError`, the orchestrator's ``RequestError``).

Like ``vllm serve``: an unknown route is Starlette's plain ``{"detail": "Not Found"}``, and a
missing or wrong API key is ``{"error": "Unauthorized"}`` (omni_cache/serving/auth.py).
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from omni_cache.runtime.request_path.results import RequestError

# The server's logger: "internal error" lines keep the name they were always logged under.
logger = logging.getLogger(__name__)

__all__ = ["APIError", "Unauthorized", "add_error_handlers", "error_body"]

#: status -> the error ``type`` vLLM's server writes for it (others: the status's phrase).
_VLLM_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}

#: Statuses ``vllm serve`` never answers, in OpenAI's own body (a rate limit's: the SDK and
#: OpenAI's clients read its ``type`` and ``code``): status -> (type, code).
_OPENAI_ERRORS = {
    429: ("requests", "rate_limit_exceeded"),
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's ``ErrorResponse`` body for an error of this status (OpenAI's for a rate limit)."""
    if status in _OPENAI_ERRORS:
        kind, code = _OPENAI_ERRORS[status]
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}
    kind = _VLLM_TYPES.get(status) or HTTPStatus(status).phrase
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class APIError(Exception):
    """An error answered as vLLM's error body with the HTTP status ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        #: Seconds until the client may try again: the ``Retry-After`` header.
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())

    @classmethod
    def from_request_error(cls, e: RequestError) -> APIError:
        return cls(e.status, e.message, param=e.param, retry_after=e.retry_after)

    @classmethod
    def from_vllm(cls, exc: Exception) -> APIError:
        """What vLLM's server answers for this exception (its status, message and param)."""
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        err = create_error_response(exc).error
        return cls(err.code, err.message, param=err.param)


class Unauthorized(Exception):
    """A missing or wrong API key: ``vllm serve``'s plain ``{"error": "Unauthorized"}`` (the
    reason, the exception's message, stays in the server's log)."""


async def _unauthorized(_: Request, exc: Unauthorized) -> JSONResponse:
    logger.info("refused a request: %s", exc)
    return JSONResponse({"error": "Unauthorized"}, status_code=401)


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
    return APIError.from_request_error(exc).response()


async def _internal(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error")
    return APIError.from_vllm(exc).response()


def add_error_handlers(app: FastAPI) -> None:
    """Answer every failure of ``app`` as ``vllm serve`` does: vLLM's handlers (they read
    ``app.state.args.log_error_stack``; the traceback of an unexpected error is logged here
    instead), then ours for the pipeline's errors."""
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    app.state.args = SimpleNamespace(log_error_stack=False)
    init_exception_handler(app)
    app.add_exception_handler(Unauthorized, _unauthorized)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(Exception, _internal)
