"""The error every media decoder raises: a content part the server cannot use (a 400)."""

from __future__ import annotations


class MediaError(ValueError):
    """A content part the server cannot use; `param` is its JSON path in the request."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
