"""Which prompt tokens a prefill worker computes in its next step. Plain Python, no torch.

Every step shares one token budget among the requests in the worker, shortest remaining
first (ties: the earlier arrival): a 40-token question is not stuck behind a 2,000-token
video prompt, which advances by whatever budget the short ones leave. A long prompt is
only held back while shorter ones fill the whole budget, i.e. when the worker is over
capacity anyway; but then without end, as long as shorter prompts keep coming. Aging bounds
that: each second a request has been in the worker counts as `aging_tokens_per_s` tokens
fewer, so a prompt of L tokens goes ahead of any newcomer after L / aging seconds at most.
(remaining - aging x waited orders as remaining + aging x added_s: a key fixed per request.)
`order_key` is that order; the simulator's prefill queues (router/sim/pools.py) sort by it too.

A chunk never enters a media item's placeholder span unless that item's embeddings have
arrived (until then the span's inputs are unknown): each request is computable up to its
first missing item (`computable_end`), and one waiting there takes no budget; and the embedding
tokens a step splices in are capped by `max_media_tokens_per_step`, so a burst of media prompts
cannot build a step's whole input out of embeddings at once.

Text before a missing item goes early only when it is at least `overlap_min_tokens` long: a
forward has a fixed cost (on CPU a 7-token one costs what ~40 prompt tokens do), so a short
prefix such as `USER: ` before an image waits and goes in one forward with the image.

Prompts finished by a step's leading chunks may share one forward (`num_packed`;
actors/engine/prompt_pack.py), which then pays that fixed cost once for all of them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Order(str, enum.Enum):
    SHORTEST_REMAINING = "shortest_remaining"  # what workers run
    ARRIVAL = "arrival"  # a queue: the baseline scripts/bench_prefill_schedule.py compares with


@dataclass(frozen=True)
class Span:
    """One media item's placeholder run in the prompt, and whether its embeddings are here."""

    offset: int
    length: int
    ready: bool = True

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class PrefillState:
    """What the scheduler needs of one request: how far it is and where its media sits."""

    request_id: str
    num_tokens: int
    num_computed: int
    spans: tuple[Span, ...] = ()
    arrival: int = 0  # order of arrival in the worker (tie-break)
    added_s: float = 0.0  # when it came (a monotonic clock): its age, for aging
    overlap_min_tokens: int = 0  # the shortest chunk worth running ahead of a missing item

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def computable_end(self) -> int:
        """How far the prompt can be computed now: up to the first span still missing its
        embeddings (encode/prefill overlap: the text before it goes while the encoder runs)."""
        return min(
            (s.offset for s in self.spans if not s.ready and s.end > self.num_computed),
            default=self.num_tokens,
        )

    @property
    def runnable(self) -> bool:
        ahead = self.computable_end - self.num_computed
        if self.computable_end == self.num_tokens:  # nothing missing ahead: whatever is left
            return ahead > 0
        return ahead >= max(self.overlap_min_tokens, 1)


@dataclass(frozen=True)
class Chunk:
    request_id: str
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def media_tokens(state: PrefillState, start: int, end: int) -> int:
    return sum(max(0, min(end, s.end) - max(start, s.offset)) for s in state.spans)


def order_key(
    num_tokens_left: int,
    added_s: float,
    arrival: int,
    order: Order = Order.SHORTEST_REMAINING,
    aging_tokens_per_s: float = 0.0,
) -> tuple[float, int]:
    """A request's place in its worker's order, smallest first: the engine's steps and the
    simulator's queues both sort by it. Shortest remaining first: tokens left less what the
    request has aged (a key fixed while it waits); ties, and arrival order: the earlier arrival."""
    if order is Order.SHORTEST_REMAINING:
        return num_tokens_left + aging_tokens_per_s * added_s, arrival
    return 0.0, arrival


def plan_step(
    states: list[PrefillState],
    max_chunk_tokens: int,
    max_media_tokens_per_step: int | None = None,
    order: Order = Order.SHORTEST_REMAINING,
    aging_tokens_per_s: float = 0.0,
) -> list[Chunk]:
    """The chunks of the next step, at most `max_chunk_tokens` tokens together (each request
    at most one chunk), in `order_key` order."""
    chunks: list[Chunk] = []
    budget, media_budget = max_chunk_tokens, max_media_tokens_per_step
    runnable = [s for s in states if s.runnable]  # a request waiting for an item costs nothing
    runnable.sort(
        key=lambda s: order_key(s.remaining, s.added_s, s.arrival, order, aging_tokens_per_s)
    )
    for state in runnable:
        if budget <= 0:
            break
        start = state.num_computed
        end = min(start + budget, state.computable_end)
        if media_budget is not None:
            end = _cap_media(state, start, end, media_budget)
            media_budget -= media_tokens(state, start, end)
        if end > start:
            chunks.append(Chunk(state.request_id, start, end))
            budget -= end - start
    return chunks


def _cap_media(state: PrefillState, start: int, end: int, media_budget: int) -> int:
    """Shorten a chunk so the embeddings it splices fit the step's media budget (a chunk
    may always take the text before its next span)."""
    for span in state.spans:
        lo, hi = max(start, span.offset), min(end, span.end)
        if hi <= lo:
            continue
        if hi - lo > media_budget:
            return lo + max(media_budget, 0)
        media_budget -= hi - lo
    return end


# A chunk joins a pack while it is at most this many times the pack's tokens so far: the equal
# prompts of a burst all pack, a 30-token text and a video's 400-token last chunk do not (the
# text would wait for the video's forward).
PACK_GROWTH = 2


def num_packed(chunks: list[Chunk], prompt_tokens: list[int], max_slots: int) -> int:
    """How many of the step's leading chunks run as one forward: each finishes its prompt
    (`prompt_tokens`, each chunk's prompt length) and is at most PACK_GROWTH times the ones
    before it, and the prompts together are at most `max_slots` long, their computed part
    included (the pack's KV buffer and mask hold it all: a prompt after a long cached prefix
    runs alone rather than have its prefix copied); fewer than two run as before."""
    num, packed_tokens, slots = 0, 0, 0
    for chunk, length in zip(chunks, prompt_tokens):
        grows_too_much = chunk.num_tokens > PACK_GROWTH * packed_tokens > 0
        if chunk.end < length or grows_too_much or slots + length > max_slots:
            break
        num, packed_tokens, slots = num + 1, packed_tokens + chunk.num_tokens, slots + length
    return num if num > 1 else 0
