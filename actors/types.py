"""Typed, frozen records that cross stage boundaries (ingress -> encoder -> prefill -> decode).

No torch here: the ingress and the router's callers import these without a model.
Tensors travel beside these records as separate top-level Ray arguments, never inside them;
a MediaItem's pixels may ride inside it as an object-store reference (`MediaItem.data_ref`).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# One spelling of the modalities, shared with the router.
from router.types import Modality  # noqa: F401


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # client went away or the request was cancelled
    ERROR = "error"


class WorkerRequestError(Exception):
    """A failure inside a worker that belongs to one request (not to the worker): that
    request alone fails, with HTTP 500, and is not retried elsewhere."""


class PixelRef:
    """Where an item's pixels wait in Ray's object store, for as long as the ingress needs
    them: once the prefill worker has the item's embeddings the ingress `drop`s its reference
    and the store frees them (a retry decodes the item again). Pickles as the bare reference,
    so Ray sees it and the receiving worker borrows it."""

    __slots__ = ("ref",)

    def __init__(self, ref: Any) -> None:
        self.ref = ref

    def drop(self) -> None:
        self.ref = None

    def __reduce__(self):
        return PixelRef, (self.ref,)


@dataclass(frozen=True)
class MediaItem:
    """One decoded, validated item. `data` layout depends on the modality:
    image HxWx3 uint8, video TxHxWx3 uint8, audio mono float32 samples.

    Once the ingress has put the pixels into Ray's object store (`stored`), `data_ref` is their
    ObjectRef and `data` a stand-in of the same shape and dtype that holds no bytes: shapes,
    sizes and placeholder counts still read from it, and pickling sends only the shape. The
    encoder fetches the pixels (`with_data`) only when its cache misses."""

    modality: Modality
    identifier: str
    data: np.ndarray = field(repr=False, compare=False)
    sample_rate_hz: int | None = None  # audio: samples per second of `data`
    frames_per_s: float | None = None  # video: rate of the sampled frames (num_frames / duration)
    data_ref: PixelRef | None = field(default=None, repr=False, compare=False)

    def stored(self, ref: Any) -> MediaItem:
        """This item with its pixels at `ref` (an ObjectRef) instead of in this process."""
        return dataclasses.replace(
            self, data=_no_bytes(self.data.shape, self.data.dtype), data_ref=PixelRef(ref)
        )

    def with_data(self, data: np.ndarray) -> MediaItem:
        """This item with its pixels here (as fetched from `data_ref`)."""
        return dataclasses.replace(self, data=data, data_ref=None)

    def __getstate__(self) -> dict:
        if self.data_ref is None:
            return self.__dict__
        # A zero-stride stand-in would pickle as a full-size copy: send its shape instead.
        return {**self.__dict__, "data": _Shape(self.data.shape, self.data.dtype.str)}

    def __setstate__(self, state: dict) -> None:
        if isinstance(state["data"], _Shape):
            state = {**state, "data": _no_bytes(state["data"].shape, np.dtype(state["data"].dtype))}
        self.__dict__.update(state)  # frozen: no __setattr__

    @property
    def size(self) -> int:
        """Size in the unit the cost model uses: pixels, frame pixels or samples."""
        return int(self.data.size // 3) if self.modality != Modality.AUDIO else int(self.data.size)

    @property
    def duration_s(self) -> float:
        """Seconds of audio or video the item covers; 0 for images (or an unknown rate)."""
        if self.modality == Modality.AUDIO and self.sample_rate_hz:
            return self.data.shape[0] / self.sample_rate_hz
        if self.modality == Modality.VIDEO and self.frames_per_s:
            return self.data.shape[0] / self.frames_per_s
        return 0.0


@dataclass(frozen=True)
class _Shape:
    shape: tuple[int, ...]
    dtype: str


def _no_bytes(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A read-only array of `shape` and `dtype` backed by a single element (all zero)."""
    return np.broadcast_to(np.zeros((), dtype), shape)


@dataclass(frozen=True)
class PlaceholderRange:
    """The run of placeholder tokens in the prompt that one item's embeddings replace.

    `grid_thw` and `seconds_per_grid` are set for vision items of models with 3-D rotary
    positions (temporal, height, width in merged patches; a video's seconds per temporal step),
    so the prefill worker can lay out positions without the pixels."""

    offset: int
    length: int
    modality: Modality = Modality.IMAGE
    grid_thw: tuple[int, int, int] | None = None
    seconds_per_grid: float | None = None


@dataclass(frozen=True)
class EncodeJob:
    request_id: str
    item: MediaItem
    num_embeddings: int
    # A prefill worker's handle (over the object store): the encoder hands it the embeddings
    # itself, as item `slot` of the request, and answers the ingress with a `Delivered`.
    deliver_to: Any = None
    slot: int = 0
    sent_at_s: float = 0.0  # wall clock as the ingress sent the call: the encoder times the hop
    # Embeddings of at most this many bytes go to `deliver_to` inside a direct link's call
    # (transport.inline_max_bytes); larger ones, or 0, through the object store.
    inline_max_bytes: int = 0


@dataclass(frozen=True)
class Delivered:
    """An encode call's answer when its embeddings went to the prefill worker from the encoder:
    how the encoding went and when the embeddings arrived there (wall clock)."""

    stats: EncodeStats
    received_at_s: float


class GrammarKind(str, enum.Enum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # a JSON value that validates against `GrammarSpec.schema`


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must parse as (structured outputs); the workers compile it.
    `schema` is the JSON schema as compact JSON text (empty for JSON_OBJECT); see `of_schema`."""

    kind: GrammarKind
    schema: str = ""

    @classmethod
    def of_schema(cls, schema: dict | bool) -> GrammarSpec:
        """Compact text in the schema's own key order: the grammar emits properties in the
        order the schema lists them, so sorting keys would reorder the output's fields."""
        return cls(GrammarKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))

    @property
    def key(self) -> str:
        """A short stable key (the workers' compile cache)."""
        text = f"{self.kind.value}\0{self.schema}".encode()
        return hashlib.sha1(text, usedforsecurity=False).hexdigest()[:16]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()  # end the request; masked until min_tokens are out
    min_tokens: int = 0
    presence_penalty: float = 0.0  # OpenAI: over generated tokens
    frequency_penalty: float = 0.0  # OpenAI: over generated tokens, per occurrence
    repetition_penalty: float = 1.0  # HF/vLLM: over prompt and generated tokens, 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    num_logprobs: int | None = None  # None: no logprobs; k: the chosen token's and the top k
    grammar: GrammarSpec | None = None  # constrained decoding: output that parses as this
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability; 0 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        """Whether sampling looks at the tokens so far (penalties, min_tokens, a grammar: a
        resumed request's matcher replays its earlier output)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.min_tokens > 0
            or self.grammar is not None
        )


@dataclass(frozen=True)
class TokenHistory:
    """The tokens a request's penalties see: its prompt, and what it generated before this
    attempt (a request resumed on another worker). Empty unless `needs_history`."""

    prompt_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()


NO_HISTORY = TokenHistory()


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the most likely alternatives, best first,
    under the model's own distribution (before penalties and temperature, as vLLM)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    placeholders: tuple[PlaceholderRange, ...]
    sampling: SamplingParams
    num_output_tokens: int = 0  # the last ones of prompt_token_ids were generated (resumed)
    # Content identifier per placeholder (the prefix cache's extra key); empty: media blocks are
    # not cached.
    media_identifiers: tuple[str, ...] = ()
    sent_at_s: float = 0.0  # wall clock as the ingress made the call (the hop's timing)


@dataclass(frozen=True)
class EncodeStats:
    """How one item's encoding went, reported back with its embeddings."""

    identifier: str
    queue_ms: float
    encode_ms: float
    batch_size: int
    cache_hit: bool = False
    finished_at_s: float = 0.0  # wall clock when the embeddings were ready (transfer timing)
    hop_in_ms: float = 0.0  # the encode call's way from the ingress to the encoder
    fetch_ms: float = 0.0  # the item's pixels fetched from the object store (a cache miss)


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token_id: int
    num_prompt_tokens: int
    queue_ms: float
    prefill_ms: float
    encode_stats: tuple[EncodeStats, ...] = ()
    rope_delta: int = (
        0  # 3-D rotary models: decode position = cache length + rope_delta (travels with the KV)
    )
    first_logprob: TokenLogprob | None = None  # when the request asked for logprobs
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    item_wait_ms: float = (
        0.0  # encode/prefill overlap: time the prefill waited for items' embeddings
    )
    # its own device time (prefill_ms, first chunk to done, also counts requests sharing its steps)
    compute_ms: float = 0.0
    # The call's way in (the worker's start less the request's sent_at_s) and the wall clock as
    # it returns (the ingress times the way out): Ray's hops, apart from the worker's own time.
    call_in_ms: float = 0.0
    returned_at_s: float = 0.0
    # From the last forward's end (first token sampled) to this answer's making: the step's
    # hand-back from the device thread to the worker's loop, on the first token's path.
    publish_ms: float = 0.0


@dataclass(frozen=True)
class DecodeRequest:
    request_id: str
    num_prompt_tokens: int
    first_token_id: int
    sampling: SamplingParams
    rope_delta: int = 0  # from PrefillResult: the position offset this request's KV was built with
    history: TokenHistory = (
        NO_HISTORY  # the first token excluded; empty unless sampling.needs_history
    )


@dataclass(frozen=True)
class TokenChunk:
    """Tokens a decode worker produced for one request since the last chunk."""

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    step_ms: float = 0.0
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token when the request asked for logprobs

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class DecodeOutput:
    """One chunk for one request's caller."""

    request_id: str
    chunk: TokenChunk


@dataclass(frozen=True)
class DecodeBatch:
    """One message from a decode worker to one ingress replica: every chunk its requests got
    since the last message (one decode step's, or several if the reader fell behind)."""

    outputs: tuple[DecodeOutput, ...]


def hop_ms(sent_at_s: float, arrived_at_s: float) -> float:
    """A hop between processes by the wall clock (`time.time()`): 0 when the sender gave no
    time, and never below 0 (nodes' clocks may disagree by a little)."""
    return max(0.0, (arrived_at_s - sent_at_s) * 1e3) if sent_at_s else 0.0
