"""Errors in OpenAI's JSON shape, with the HTTP status each kind deserves.

Every failure a client can see is an `APIError`: handlers raise it, the app turns it into
``{"error": {"message", "type", "param", "code"}}``. Anything else that escapes a handler is a
bug; it is logged with its traceback here and answered with a generic 500, never the trace.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error a client should see. `code` is a stable machine-readable name (also the metrics label)."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class InvalidRequest(APIError):
    """Malformed JSON, a wrong type, a value out of range, a missing field: 400."""


class Unauthorized(APIError):
    status = 401
    code = "invalid_api_key"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"www-authenticate": "Bearer"})


class NotFound(APIError):
    status = 404
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"

    def __init__(self, model: str, served: str) -> None:
        super().__init__(f"The model {model!r} does not exist; this server serves {served!r}", param="model")


class MethodNotAllowed(APIError):
    status = 405
    code = "method_not_allowed"


class RequestTooLarge(APIError):
    status = 413
    code = "request_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"The request body exceeds the limit of {limit} bytes")


class TooManyRequests(APIError):
    """429 with retry-after: come back later."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message, headers={"retry-after": str(max(1, round(retry_after)))})


class Overloaded(TooManyRequests):
    """Too many requests in flight on this gateway."""

    code = "too_many_requests_in_flight"

    def __init__(self, limit: int, retry_after: float) -> None:
        super().__init__(f"The server is handling its limit of {limit} requests; retry after {retry_after:g} s",
                         retry_after)


class ClusterBusy(TooManyRequests):
    """Every instance would only queue the request (admission by load)."""

    code = "cluster_overloaded"

    def __init__(self, reason: str, retry_after: float) -> None:
        super().__init__(f"The cluster is at capacity ({reason}); retry after {retry_after:g} s", retry_after)


class ServerError(APIError):
    status = 500
    type = "server_error"
    code = "internal_error"


class Unavailable(APIError):
    """No instance can take a request now (none ready, or the cluster is unreachable): 503."""

    status = 503
    type = "server_error"
    code = "no_ready_instance"


def _from_http_exception(exc: HTTPException, request: Request) -> APIError:
    """Starlette's own errors (no such route, wrong method) in the same shape as ours."""
    if exc.status_code == 404:
        return NotFound(f"There is no route {request.url.path}")
    if exc.status_code == 405:
        return MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}")
    if exc.status_code < 500:
        return InvalidRequest(str(exc.detail))
    return ServerError(str(exc.detail))


async def handle_http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return _from_http_exception(exc, request).response()


def unexpected(exc: BaseException, request: Request) -> ServerError:
    """A bug: log it with its traceback for the operator, tell the client only that it happened."""
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return ServerError("The server had an error while processing the request")


async def handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    return unexpected(exc, request).response()


EXCEPTION_HANDLERS = {
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
