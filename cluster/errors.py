"""The error that ends a request with an HTTP status, in OpenAI's shape."""

from __future__ import annotations


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
