"""Records the router reads and returns. Plain Python: no torch, no Ray.

The live cluster and the simulator build the same records, so every policy and the
cost model run unchanged in both.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class WorkerKind(str, enum.Enum):
    ENCODER = "encoder"
    PREFILL = "prefill"
    DECODE = "decode"


class Placement(str, enum.Enum):
    """Where two workers are relative to each other; transfer bandwidth depends on it."""

    SAME_PROCESS = "same_process"
    SAME_NODE = "same_node"
    CROSS_NODE = "cross_node"


@dataclass(frozen=True)
class WorkerInfo:
    """A worker as the router knows it: static facts, not load."""

    kind: WorkerKind
    index: int
    node: str = "node-0"
    modalities: frozenset[str] = frozenset()  # encoders: the towers it hosts ("image", "video", "audio")
    process: str | None = None  # an encoder and a prefill worker sharing one process: SAME_PROCESS transfer


@dataclass(frozen=True)
class MediaJob:
    """One media item of a request, as the cost model sees it."""

    identifier: str
    modality: str  # "image" | "video" | "audio"
    size: float  # in the modality's cost unit: megapixels, frames, seconds
    num_embeddings: int
    embedding_bytes: int


@dataclass(frozen=True)
class RequestProfile:
    """What the router knows of a request before it runs."""

    num_prompt_tokens: int
    items: tuple[MediaJob, ...] = ()
    prefix_hashes: tuple[str, ...] = ()  # block hashes of the prompt, in order
    block_size: int = 16  # tokens per prefix block
    max_tokens: int = 16

    @property
    def num_items(self) -> int:
        return len(self.items)

    @property
    def modalities(self) -> frozenset[str]:
        return frozenset(item.modality for item in self.items)


@dataclass(frozen=True)
class TTFTEstimate:
    """The cost model's estimate for one (encoder, prefill) pair, in milliseconds."""

    encoder_queue_ms: float = 0.0
    encode_ms: float = 0.0
    transfer_ms: float = 0.0
    prefill_queue_ms: float = 0.0
    prefill_ms: float = 0.0

    @classmethod
    def of(cls, encoder_queue_ms: float, encode_ms: float, transfer_ms: float, prefill_queue_ms: float, prefill_ms: float) -> TTFTEstimate:
        """TTFTEstimate(...) with every field given, at about half the cost: the router builds one per
        request, and a frozen dataclass's generated __init__ sets each field through
        object.__setattr__. tests/unit/test_router.py checks both build equal records."""
        record = object.__new__(cls)
        object.__setattr__(record, "__dict__", {"encoder_queue_ms": encoder_queue_ms, "encode_ms": encode_ms, "transfer_ms": transfer_ms,
                                                "prefill_queue_ms": prefill_queue_ms, "prefill_ms": prefill_ms})
        return record

    @property
    def total_ms(self) -> float:
        # A sum, not a max: the ingress queues the prefill only once the embeddings are
        # in, so the prefill queue does not overlap encoding.
        return self.encoder_queue_ms + self.encode_ms + self.transfer_ms + self.prefill_queue_ms + self.prefill_ms


@dataclass(frozen=True)
class RouteDecision:
    """Indices into each pool; `encoder` is None for a text-only request."""

    encoder: int | None
    prefill: int
    decode: int
    estimate: TTFTEstimate = field(default_factory=TTFTEstimate)
    # What the completions need to release the dispatched work and calibrate the cost model:
    items: tuple[MediaJob, ...] = ()  # all media items of the request
    encode_items: tuple[MediaJob, ...] = ()  # the ones the chosen encoder was expected to encode (cache misses)
    uncached_tokens: int = 0  # prompt tokens the chosen prefill worker was expected to compute

    @classmethod
    def of(cls, encoder: int | None, prefill: int, decode: int, estimate: TTFTEstimate, items: tuple[MediaJob, ...],
           encode_items: tuple[MediaJob, ...], uncached_tokens: int) -> RouteDecision:
        """RouteDecision(...) with every field given, at about half the cost (see TTFTEstimate.of)."""
        record = object.__new__(cls)
        object.__setattr__(record, "__dict__", {"encoder": encoder, "prefill": prefill, "decode": decode, "estimate": estimate,
                                                "items": items, "encode_items": encode_items, "uncached_tokens": uncached_tokens})
        return record

    @property
    def estimated_ttft_ms(self) -> float:
        return self.estimate.total_ms


# -- additions for the router proper (cost model, view, policies) ---------------------------


class WorkerState(str, enum.Enum):
    """Why a worker is or is not a routing candidate."""

    UP = "up"
    DOWN = "down"  # marked unhealthy (set_healthy(False)), e.g. by the supervisor
    SILENT = "silent"  # reported before, but not within dead_after_s


@dataclass(frozen=True)
class WorkerReport:
    """What a worker last published about itself (None: that report carried no such field)."""

    at_s: float
    queued: int | None = None
    running: int | None = None
    cached_identifiers: frozenset[str] | None = None
    prefix_hashes: frozenset[str] | None = None
