"""Records the router reads and returns. Plain Python: no torch, no Ray.

The live cluster and the simulator build the same records, so every policy and the
cost model run unchanged in both.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Modality(str, enum.Enum):
    """The kinds of media item; the one spelling of them (actors.types re-exports it). A str enum,
    so a member and its value are equal, hash alike and may key the same dict."""

    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


ALL_MODALITIES: frozenset[str] = frozenset(m.value for m in Modality)


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
    modalities: frozenset[str] = frozenset()  # encoders: the towers it hosts (Modality values)
    process: str | None = (
        None  # an encoder and a prefill worker sharing one process: SAME_PROCESS transfer
    )


@dataclass(frozen=True)
class MediaJob:
    """One media item of a request, as the cost model sees it."""

    identifier: str
    modality: str  # a Modality value
    size: float  # in the modality's cost unit: megapixels, frames, seconds
    num_embeddings: int
    embedding_bytes: int

    @classmethod
    def of(
        cls, identifier: str, modality: str, size: float, num_embeddings: int, embedding_bytes: int
    ) -> MediaJob:
        """MediaJob(...) with every field given, at about half the cost (see TTFTEstimate.of): the
        simulator builds one per media item, a million requests' worth."""
        record = object.__new__(cls)
        object.__setattr__(
            record,
            "__dict__",
            {
                "identifier": identifier,
                "modality": modality,
                "size": size,
                "num_embeddings": num_embeddings,
                "embedding_bytes": embedding_bytes,
            },
        )
        return record


@dataclass(frozen=True)
class RequestProfile:
    """What the router knows of a request before it runs."""

    num_prompt_tokens: int
    items: tuple[MediaJob, ...] = ()
    prefix_hashes: tuple[str, ...] = ()  # block hashes of the prompt, in order
    block_size: int = 16  # tokens per prefix block
    max_tokens: int = 16

    @classmethod
    def of(
        cls,
        num_prompt_tokens: int,
        items: tuple[MediaJob, ...],
        prefix_hashes: tuple[str, ...],
        block_size: int,
        max_tokens: int,
    ) -> RequestProfile:
        """RequestProfile(...) with every field given, at about half the cost (see MediaJob.of)."""
        record = object.__new__(cls)
        object.__setattr__(
            record,
            "__dict__",
            {
                "num_prompt_tokens": num_prompt_tokens,
                "items": items,
                "prefix_hashes": prefix_hashes,
                "block_size": block_size,
                "max_tokens": max_tokens,
            },
        )
        return record

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
    def of(
        cls,
        encoder_queue_ms: float,
        encode_ms: float,
        transfer_ms: float,
        prefill_queue_ms: float,
        prefill_ms: float,
    ) -> TTFTEstimate:
        """TTFTEstimate(...) with every field given, at about half the cost: the router builds one
        per request, and a frozen dataclass's generated __init__ sets each field through
        object.__setattr__. tests/unit/test_router.py checks both build equal records."""
        record = object.__new__(cls)
        object.__setattr__(
            record,
            "__dict__",
            {
                "encoder_queue_ms": encoder_queue_ms,
                "encode_ms": encode_ms,
                "transfer_ms": transfer_ms,
                "prefill_queue_ms": prefill_queue_ms,
                "prefill_ms": prefill_ms,
            },
        )
        return record

    @property
    def total_ms(self) -> float:
        # A sum, not a max: the ingress queues the prefill only once the embeddings are
        # in, so the prefill queue does not overlap encoding.
        return (
            self.encoder_queue_ms
            + self.encode_ms
            + self.transfer_ms
            + self.prefill_queue_ms
            + self.prefill_ms
        )


@dataclass(frozen=True)
class EncoderShare:
    """The part of a request one encoder serves when no single encoder hosts all of its
    modalities (a pool split by modality: e.g. vision towers on some encoders, audio on others)."""

    encoder: int
    modalities: tuple[str, ...]  # the modalities of the items sent to it, sorted
    num_items: int  # items dispatched to it, cache hits included (what the view books and releases)
    encode_items: tuple[MediaJob, ...]  # the ones it was expected to encode (cache misses)
    queue_ms: float  # its estimated queue ahead of them (0 when all are hits)
    encode_ms: float  # its estimated encode time of encode_items (booked on it)
    transfer_ms: float  # its embeddings to the chosen prefill worker

    @classmethod
    def of(
        cls,
        encoder: int,
        modalities: tuple[str, ...],
        num_items: int,
        encode_items: tuple[MediaJob, ...],
        queue_ms: float,
        encode_ms: float,
        transfer_ms: float,
    ) -> EncoderShare:
        """EncoderShare(...) with every field given, at about half the cost (TTFTEstimate.of)."""
        record = object.__new__(cls)
        object.__setattr__(
            record,
            "__dict__",
            {
                "encoder": encoder,
                "modalities": modalities,
                "num_items": num_items,
                "encode_items": encode_items,
                "queue_ms": queue_ms,
                "encode_ms": encode_ms,
                "transfer_ms": transfer_ms,
            },
        )
        return record


@dataclass(frozen=True)
class RouteDecision:
    """Indices into each pool; `encoder` is None for a text-only request.

    Usually one encoder encodes every item (`shares` is empty). When no healthy encoder hosts
    all of the request's modalities, `shares` says which encoder takes which modality, one
    share per encoder, the main one (`encoder`, routed jointly with the prefill worker) first;
    the estimate then follows the share that finishes last (they run in parallel). Use
    `encoder_for(item.modality)` to send each item to its encoder."""

    encoder: int | None
    prefill: int
    decode: int
    estimate: TTFTEstimate = field(default_factory=TTFTEstimate)
    # What the completions need to release the dispatched work and calibrate the cost model:
    items: tuple[MediaJob, ...] = ()  # all media items of the request
    encode_items: tuple[
        MediaJob, ...
    ] = ()  # the ones the chosen encoder(s) were expected to encode (cache misses)
    uncached_tokens: int = 0  # prompt tokens the chosen prefill worker was expected to compute
    shares: tuple[
        EncoderShare, ...
    ] = ()  # empty unless the request is split across encoders by modality

    @classmethod
    def of(
        cls,
        encoder: int | None,
        prefill: int,
        decode: int,
        estimate: TTFTEstimate,
        items: tuple[MediaJob, ...],
        encode_items: tuple[MediaJob, ...],
        uncached_tokens: int,
        shares: tuple[EncoderShare, ...] = (),
    ) -> RouteDecision:
        """RouteDecision(...) with every field given, at about half the cost (TTFTEstimate.of)."""
        record = object.__new__(cls)
        object.__setattr__(
            record,
            "__dict__",
            {
                "encoder": encoder,
                "prefill": prefill,
                "decode": decode,
                "estimate": estimate,
                "items": items,
                "encode_items": encode_items,
                "uncached_tokens": uncached_tokens,
                "shares": shares,
            },
        )
        return record

    @property
    def estimated_ttft_ms(self) -> float:
        return self.estimate.total_ms

    def encoder_for(self, modality: str) -> int | None:
        """The encoder that encodes this request's items of `modality` (None: text-only, or a
        split request without items of that modality)."""
        if not self.shares:
            return self.encoder
        for share in self.shares:
            if modality in share.modalities:
                return share.encoder
        return None

    @property
    def encoder_by_modality(self) -> tuple[tuple[str, int], ...]:
        """(modality, encoder) for each modality of the request's items, sorted by modality."""
        if not self.shares:
            if self.encoder is None:
                return ()
            return tuple((m, self.encoder) for m in sorted({item.modality for item in self.items}))
        return tuple(sorted((m, share.encoder) for share in self.shares for m in share.modalities))

    @property
    def encoders(self) -> tuple[int, ...]:
        """Every encoder the request uses, the main one first."""
        if self.shares:
            return tuple(share.encoder for share in self.shares)
        return () if self.encoder is None else (self.encoder,)


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
