"""The API key check, as pure ASGI middleware: a response streams through it untouched.
(Starlette's `BaseHTTPMiddleware` copies every streamed chunk through a memory stream and
a task of its own: a cost per token of every stream.)"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from cluster.request_log import bearer_ok
from cluster.response_models import error_body

# Every route but the probes': /tokenize and /detokenize (which vLLM leaves open) expose the
# chat template and spend the ingress's CPU as a /v1 route does.
GUARDED = ("/v1", "/tokenize", "/detokenize")


class ApiKeyMiddleware:
    """With `server.api_key` set (the app's `state.api_key`), every /v1 route, /tokenize and
    /detokenize want `Authorization: Bearer <key>`; /health and /metrics stay open for
    probes and scrapers."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(GUARDED):
            key = getattr(scope["app"].state, "api_key", None)
            if key and not bearer_ok(_header(scope, b"authorization"), key):
                await _refusal()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _refusal() -> JSONResponse:
    body = error_body(
        "a valid API key is required: send `Authorization: Bearer <key>`",
        type="authentication_error",
        code="invalid_api_key",
    )
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
