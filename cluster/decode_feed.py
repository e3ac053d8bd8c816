"""An ingress replica's end of the decode workers' output: one Ray stream per decode worker
(`DecodeWorker.stream`), one message per step carrying the chunks of all of this replica's
requests on that worker, fanned out here to each request's queue. A worker that dies ends
its stream with the error, which every request waiting on it raises (and is retried)."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Callable

import ray.exceptions as rx

from actors import wire
from actors.types import DecodeBatch, TokenChunk
from actors.worker_links import link_lost, open_link
from cluster.leftovers import detached

Opener = Callable[[], AsyncIterator[DecodeBatch]]


class DecodeFeed:
    """One decode worker's stream, read by one task while the worker lives."""

    def __init__(self, open_stream: Opener, on_step: Callable[[float], None] | None = None):
        self._open = open_stream
        self._on_step = on_step  # told each step's ms once, not once per request in it
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self.failure: BaseException | None = None

    def listen(self, request_id: str) -> None:
        """Start keeping `request_id`'s chunks (before its request is submitted)."""
        if self.failure is not None:
            raise self.failure
        self._queues[request_id] = asyncio.Queue()
        if self._reader is None:  # in a context of its own: no request's cancellation ends it
            self._reader = asyncio.get_running_loop().create_task(
                self._read(), context=contextvars.Context()
            )

    def forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def chunks(self, request_id: str, stream_interval: int) -> AsyncIterator[TokenChunk]:
        """The request's chunks, each of at least `stream_interval` tokens unless it is the
        last (a reader that fell behind gets everything waiting at once)."""
        queue = self._queues[request_id]
        while True:
            chunk = await _gather(queue, stream_interval)
            yield chunk
            if chunk.finished:
                return

    async def _read(self) -> None:
        try:
            async for batch in self._open():
                steps_ms = set()
                for out in batch.outputs:
                    steps_ms.add(out.chunk.step_ms)
                    if (queue := self._queues.get(out.request_id)) is not None:
                        queue.put_nowait(out.chunk)
                if self._on_step is not None:
                    for step_ms in steps_ms - {0.0}:  # a message may carry several steps
                        self._on_step(step_ms)
            raise rx.ActorUnavailableError("the decode worker's stream ended", None)
        except Exception as exc:  # noqa: BLE001 - every listener gets it, whatever it is
            self.failure = exc
            for queue in self._queues.values():
                queue.put_nowait(exc)


async def _gather(queue: asyncio.Queue, stream_interval: int) -> TokenChunk:
    first = await _next(queue)
    if queue.empty() and (first.finished or len(first.token_ids) >= stream_interval):
        return first  # the usual case: one step's chunk, passed on as it came
    tokens, logprobs, last = list(first.token_ids), list(first.logprobs), first
    while not (last.finished or (queue.empty() and len(tokens) >= stream_interval)):
        last = await _next(queue)
        tokens.extend(last.token_ids)
        logprobs.extend(last.logprobs)
    return TokenChunk(tuple(tokens), last.finish_reason, last.step_ms, tuple(logprobs))


async def _next(queue: asyncio.Queue) -> TokenChunk:
    item = queue.get_nowait() if not queue.empty() else await queue.get()
    if isinstance(item, BaseException):
        raise item
    return item


def ray_stream(worker, owner: str) -> Opener:
    """The opener of `worker`'s stream for this replica (`owner` tags its requests)."""

    async def batches() -> AsyncIterator[DecodeBatch]:
        stream = detached(worker.stream.options(num_returns="streaming").remote, owner)
        async for ref in stream:
            yield await ref

    return batches


def link_stream(worker, owner: str) -> Opener:
    """The opener of `worker`'s stream over a direct link (actors/wire.py); over Ray when the
    link cannot connect. A link that breaks reads as the actor gone, naming it."""

    async def batches() -> AsyncIterator[DecodeBatch]:
        messages = await open_link(worker, lambda address: wire.open_stream(address, owner))
        messages = messages or ray_stream(worker, owner)()
        try:
            async for batch in messages:
                yield batch
        except wire.LinkClosed as exc:
            raise link_lost(worker, exc) from None
        finally:
            await messages.aclose()

    return batches


class DecodeFeeds:
    """This replica's feeds, one per live decode actor (a restarted worker is a new actor)."""

    def __init__(
        self, owner: str, on_step: Callable[[float], None] | None = None, direct: bool = True
    ):
        self.owner, self._on_step = owner, on_step
        self._open = link_stream if direct else ray_stream
        self._feeds: dict[str, DecodeFeed] = {}

    def of(self, worker) -> DecodeFeed:
        key = worker._actor_id.hex()
        feed = self._feeds.get(key)
        if feed is None or feed.failure is not None:
            self._feeds = {k: f for k, f in self._feeds.items() if f.failure is None}
            feed = self._feeds[key] = DecodeFeed(self._open(worker, self.owner), self._on_step)
        return feed
