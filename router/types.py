"""Records the router reads and returns. Plain Python: no torch, no Ray."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class WorkerKind(str, enum.Enum):
    ENCODER = "encoder"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class RequestProfile:
    """What the router knows of a request before it runs."""

    num_prompt_tokens: int
    num_items: int
    modalities: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RouteDecision:
    """Indices into each pool; `encoder` is None for a text-only request."""

    encoder: int | None
    prefill: int
    decode: int
