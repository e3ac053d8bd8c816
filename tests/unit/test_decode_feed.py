"""An ingress replica's decode feed (cluster/decode_feed.py), without Ray: one message per step
fanned out to each request in order, a reader that fell behind getting what waits in one chunk,
each step's time counted once, and a worker's failure raised in every listener."""

from __future__ import annotations

import asyncio

import pytest

from actors.types import DecodeBatch, DecodeOutput, FinishReason, TokenChunk
from cluster.decode_feed import DecodeFeed

STOP = FinishReason.LENGTH


def _step(step_ms: float, *rows: tuple[str, int, FinishReason | None]) -> DecodeBatch:
    return DecodeBatch(
        tuple(DecodeOutput(rid, TokenChunk((tok,), reason, step_ms)) for rid, tok, reason in rows)
    )


def _feed(batches: list[DecodeBatch], failure: Exception | None = None):
    release = asyncio.Event()
    steps: list[float] = []

    async def stream():
        await release.wait()  # every request listens before the first step
        for batch in batches:
            yield batch
            await asyncio.sleep(0)
        if failure is not None:
            raise failure
        await asyncio.Event().wait()  # a live worker's stream does not end

    return DecodeFeed(stream, steps.append), release, steps


async def _read(feed: DecodeFeed, request_id: str, interval: int = 1, lag_s: float = 0.0):
    chunks = []
    async for chunk in feed.chunks(request_id, interval):
        chunks.append(chunk)
        await asyncio.sleep(lag_s)
    return chunks


def test_each_request_gets_its_tokens_in_order_and_each_step_counts_once():
    batches = [
        _step(5.0, ("a", 1, None), ("b", 10, None)),
        _step(6.0, ("a", 2, STOP), ("b", 11, None)),
    ]
    batches.append(_step(7.0, ("b", 12, STOP)))

    async def main():
        feed, release, steps = _feed(batches)
        feed.listen("a"), feed.listen("b")
        readers = [asyncio.ensure_future(_read(feed, r)) for r in ("a", "b")]
        release.set()
        a, b = await asyncio.gather(*readers)
        return a, b, steps

    a, b, steps = asyncio.run(main())
    assert [c.token_ids for c in a] == [(1,), (2,)] and a[-1].finish_reason is STOP
    assert [c.token_ids for c in b] == [(10,), (11,), (12,)]
    assert steps == [5.0, 6.0, 7.0]  # once a step, whatever the number of requests in it


def test_a_reader_behind_gets_what_waits_in_one_chunk_in_order():
    batches = [_step(1.0, ("a", t, STOP if t == 5 else None)) for t in range(1, 6)]

    async def main():
        feed, release, _ = _feed(batches)
        feed.listen("a")
        reader = asyncio.ensure_future(_read(feed, "a", interval=2, lag_s=0.01))
        release.set()
        return await reader

    chunks = asyncio.run(main())
    assert [t for c in chunks for t in c.token_ids] == [1, 2, 3, 4, 5]
    assert len(chunks) < 5 and chunks[-1].finished  # gathered, never split or reordered
    assert all(len(c.token_ids) >= 2 for c in chunks[:-1])


def test_a_failed_worker_fails_every_listener():
    async def main():
        feed, release, _ = _feed([_step(1.0, ("a", 1, None))], RuntimeError("worker died"))
        feed.listen("a"), feed.listen("b")
        readers = [asyncio.ensure_future(_read(feed, r)) for r in ("a", "b")]
        release.set()
        return await asyncio.gather(*readers, return_exceptions=True)

    for outcome in asyncio.run(main()):
        assert isinstance(outcome, RuntimeError)
    with pytest.raises(RuntimeError):  # and a request that comes later learns it at once
        asyncio.run(_listen_after_failure())


async def _listen_after_failure():
    feed, release, _ = _feed([], RuntimeError("worker died"))
    feed.listen("a")
    release.set()
    with pytest.raises(RuntimeError):
        await _read(feed, "a")
    feed.listen("b")
