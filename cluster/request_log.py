"""One log line per finished request (logger `ray.serve.epd.requests`): id, outcome, tokens, TTFT
and end-to-end time, each phase of the TTFT, and the prompt's text only where the config asks
for it."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

# A child of Serve's logger, so the line lands in the replica's log beside Serve's own access lines.
log = logging.getLogger("ray.serve.epd.requests")
MIN_PHASE_MS = 0.05  # a phase shorter than this would print as 0.0: the line leaves it out


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    status: str  # "ok", an HTTP status, or "aborted"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    finish_reason: str | None = None
    prompt: str | None = None
    # the TTFT's phases (RequestTimings.phases_ms); those under MIN_PHASE_MS are left out
    phases_ms: Mapping[str, float] | None = None
    x_request_id: str | None = field(default_factory=lambda: _serve_request_id())

    def line(self) -> str:
        parts = [
            f"request {self.request_id}",
            f"x_request_id={self.x_request_id}",
            f"status={self.status}",
            f"prompt_tokens={self.prompt_tokens}",
            f"completion_tokens={self.completion_tokens}",
        ]
        if self.finish_reason:
            parts.append(f"finish_reason={self.finish_reason}")
        parts += [
            f"{name}={value:.1f}"
            for name, value in (("ttft_ms", self.ttft_ms), ("e2e_ms", self.e2e_ms))
            if value is not None
        ]
        parts += [
            f"{name}={value:.1f}"
            for name, value in (self.phases_ms or {}).items()
            if value >= MIN_PHASE_MS
        ]
        if self.prompt is not None:
            parts.append(f"prompt={self.prompt!r}")
        return " ".join(parts)


class RequestLog:
    def __init__(self, enabled: bool, with_prompts: bool):
        self.enabled, self.with_prompts = enabled, with_prompts

    def write(self, record: RequestRecord) -> None:
        if self.enabled:
            log.info(record.line())


def _serve_request_id() -> str | None:
    """The x-request-id Serve's proxy gave this request (the client's own, or one it made)."""
    try:
        from ray.serve.context import _get_serve_request_context

        return _get_serve_request_context().request_id or None
    except Exception:  # outside a Serve request
        return None


def bearer_ok(authorization: str | None, api_key: str) -> bool:
    """Whether an Authorization header carries `Bearer <api_key>` (constant-time compare)."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode(), api_key.encode()
    )
