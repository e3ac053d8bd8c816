"""The error that ends a request with an HTTP status, in OpenAI's shape, and its response."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from cluster.backpressure import Overloaded
from cluster.response_models import error_body


class RequestError(Exception):
    """Ends a request with an HTTP error in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status,
            message,
            param,
            type,
            code,
        )
        self.retry_after_s = retry_after_s  # sent as Retry-After (429, 503)


def overloaded(exc: Overloaded, retry_after_s: int) -> RequestError:
    """Back-pressure's refusal: 429, and when to retry."""
    return RequestError(
        429,
        exc.message,
        type="rate_limit_error",
        code="server_overloaded",
        retry_after_s=retry_after_s,
    )


def error_response(exc: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    """Serve adds the x-request-id (the request log line pairs it with `request_id`); a
    response made before Serve sees the request passes its own in `headers`."""
    headers = dict(headers or {})
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    body = error_body(exc.message, type=exc.type, param=exc.param, code=exc.code)
    return JSONResponse(body, status_code=exc.status, headers=headers)
